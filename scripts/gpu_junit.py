"""Verdict on a ``pytest -m gpu`` run from its JUnit XML: on a GPU machine, skipped is failed.

    python scripts/gpu_junit.py RESULTS.xml [--gpu]

Prints one line (``passed N failed N errors N skipped N``) and exits 0 only when no test
failed or errored and, with ``--gpu`` (the machine has a GPU), at least one test passed and
none was skipped: a GPU test that skips on a GPU machine means the check did not run.
Uses only the standard library (it runs before anything else is known to work).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> dict[str, int]:
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if "error" in tags:
            c["errors"] += 1
        elif "failure" in tags:
            c["failed"] += 1
        elif "skipped" in tags:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    for suite in ET.parse(path).getroot().iter("testsuite"):  # collection errors: no testcase
        c["errors"] = max(c["errors"], int(suite.get("errors", 0)))
    return c


def verdict(c: dict[str, int], gpu: bool) -> str | None:
    """None when the run is good, else why not."""
    if c["failed"] or c["errors"]:
        return f"{c['failed']} failed, {c['errors']} errors"
    if gpu and c["skipped"]:
        return f"{c['skipped']} GPU test(s) skipped on a machine with a GPU"
    if gpu and not c["passed"]:
        return "no GPU test passed"
    return None


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--gpu"]
    if len(args) != 1:
        print("usage: gpu_junit.py RESULTS.xml [--gpu]", file=sys.stderr)
        return 2
    try:
        c = counts(args[0])
    except (OSError, ET.ParseError) as e:
        print(f"error: cannot read {args[0]}: {e}", file=sys.stderr)
        return 2
    why = verdict(c, "--gpu" in argv)
    print(" ".join(f"{k} {v}" for k, v in c.items()) + ("" if why is None else f": FAIL ({why})"))
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
