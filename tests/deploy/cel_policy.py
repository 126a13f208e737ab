"""A rendered ValidatingAdmissionPolicy evaluated offline (``celpy``, the `test` extra's
cel-python): what the API server would answer for one pod in one namespace.

:func:`admit` follows the API server's order: the policy's ``matchConditions`` (all
true, or the policy does not apply), its ``variables`` (in order, each seeing those
before it), then every ``validation``; an expression that fails to evaluate refuses, as
``failurePolicy: Fail`` does. It returns the messages of the failed validations (empty:
admitted; None: the policy does not apply). Bindings (which namespaces) are not
evaluated here: tests check their selectors as data.
"""

from __future__ import annotations

from typing import Any

import pytest

celpy = pytest.importorskip("celpy", reason="cel-python (the `test` extra)")

Obj = dict[str, Any]


def _run(env: Any, expr: str, activation: dict[str, Any]) -> Any:
    """The value of ``expr``, or an Exception (a failed evaluation)."""
    try:
        out = env.program(env.compile(expr)).evaluate(activation)
    except Exception as e:  # celpy raises CELEvalError (and lark errors at compile)
        return e
    return e if isinstance(e := out, Exception) else out


def _map(values: dict[str, Any]) -> Any:
    """CEL values by name as a CEL map (json_to_cel would turn a BoolType into an int)."""
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})


def admit(policy: Obj, pod: Obj, namespace: Obj | None = None) -> list[str] | None:
    spec = policy["spec"]
    env = celpy.Environment()
    ns = namespace or {"metadata": {"name": pod["metadata"].get("namespace", "t")}}
    activation: dict[str, Any] = {"object": celpy.json_to_cel(pod),
                                  "namespaceObject": celpy.json_to_cel(ns)}
    for cond in spec.get("matchConditions", []):
        got = _run(env, cond["expression"], activation)
        if isinstance(got, Exception):
            return [f"{cond['name']}: {got}"]
        if not got:
            return None
    variables: dict[str, Any] = {}
    for var in spec.get("variables", []):
        activation["variables"] = _map(variables)
        got = _run(env, var["expression"], activation)
        if isinstance(got, Exception):
            return [f"variable {var['name']}: {got}"]
        variables[var["name"]] = got
    activation["variables"] = _map(variables)
    refused = []
    for v in spec["validations"]:
        got = _run(env, v["expression"], activation)
        if isinstance(got, Exception) or not got:
            refused.append(v["message"] + (f" ({got})" if isinstance(got, Exception) else ""))
    return refused
