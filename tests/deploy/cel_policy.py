"""A rendered ValidatingAdmissionPolicy evaluated offline (``celpy``, the `test` extra's
cel-python): what the API server would answer for one object (a pod, a claim template)
in one namespace.

:func:`admit` follows the API server's order: the policy's ``matchConditions`` (all
true, or the policy does not apply), its ``variables`` (in order, each seeing those
before it), then every ``validation``; an expression that fails to evaluate refuses, as
``failurePolicy: Fail`` does. It returns the messages of the failed validations (empty:
admitted; None: the policy does not apply). Bindings (which namespaces) are not
evaluated here: tests check their selectors as data. Kubernetes' quantity functions are
:data:`FUNCTIONS`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import pytest

celpy = pytest.importorskip("celpy", reason="cel-python (the `test` extra)")

Obj = dict[str, Any]

_SUFFIX = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$")


class Quantity:
    """A value of Kubernetes' CEL quantity library (``quantity``, ``isQuantity``,
    ``isInteger``, ``asInteger``), as far as the chart's policies use it: non-negative
    numbers with a binary or decimal suffix (no exponent form)."""

    def __init__(self, text: str):
        m = _QUANTITY.match(text)
        if not m:
            raise ValueError(f"not a quantity: {text!r}")
        self.value = Fraction(m.group(1)) * _SUFFIX[m.group(2) or ""]


def _is_quantity(text: Any) -> Any:
    return celpy.celtypes.BoolType(_QUANTITY.match(str(text)) is not None)


FUNCTIONS = {
    "quantity": lambda text: Quantity(str(text)),
    "isQuantity": _is_quantity,
    "isInteger": lambda q: celpy.celtypes.BoolType(q.value.denominator == 1),
    "asInteger": lambda q: celpy.celtypes.IntType(int(q.value)),
}


def _run(env: Any, expr: str, activation: dict[str, Any]) -> Any:
    """The value of ``expr``, or an Exception (a failed evaluation)."""
    try:
        out = env.program(env.compile(expr), functions=FUNCTIONS).evaluate(activation)
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
