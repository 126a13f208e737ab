"""A trainer process for the in-place publish tests: registers as a trainer on the
daemon of ``--run-dir``, puts the policy of ``MODEL`` into a mutable weight set of the
engine's layout, has the engine at ``URL`` read it (version 1), then opens the back
buffer and writes garbage into its first half, prints ``{"event": "writing", ...}`` and
waits for stdin EOF (a test kills it there: mid-publish)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvpool.client_lib.trainer import connect_trainer
from kvpool.demo.policy import Policy
from kvpool.demo.rl_loop import publish_mutable
from kvpool.engine_adapters.bundled.inplace_trainer import InPlaceWeights, placement


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("url")
    ap.add_argument("--run-dir", required=True)
    a = ap.parse_args()
    tr = connect_trainer("trainer", run_dir=a.run_dir, shares=64)
    policy = Policy.load(a.model)
    placed = placement(a.model, torch.float32, {n: policy.w(n) for n in policy.names})
    assert not isinstance(placed, str), placed
    w = InPlaceWeights.create(tr.tenant, placed,
                              {n: policy.params[i] for i, n in enumerate(policy.names)})
    version = publish_mutable(a.url, w.nonce)["version"]
    b = w.writer.begin_write()
    for i, view in enumerate(w.views[b].values()):
        if i % 2 == 0:
            view.fill_(1e3)  # half the tensors of the next version, never published
    print(json.dumps({"event": "writing", "version": version, "buffer": b,
                      "nonce": w.nonce}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
