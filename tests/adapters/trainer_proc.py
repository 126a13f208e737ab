"""A trainer process for the real-process tests (``python trainer_proc.py --run-dir DIR``):
a kvpool trainer tenant training a small MLP whose parameters, gradients and AdamW state
live in the pool (:mod:`kvpool.client_lib.trainer`).

One command per stdin line, one JSON line per answer on stdout:

* ``train NBYTES STEPS`` — enter ``trainer.step(NBYTES)``, run STEPS optimizer steps in
  it and say ``{"event": "trained", "loss": [...], "in_pool": bool}`` still inside the
  step; the next line (``end``) leaves it: ``{"event": "ended"}``. A refused step says
  ``{"event": "refused", "error": "StepDeadline"|"StepTooLarge", "message": ...}``;
* ``hold NBYTES`` — enter a step of NBYTES, say ``{"event": "in_step"}`` and stay in it
  (the test kills the process there);
* ``offload`` — the optimizer state out of the pool: ``{"event": "offloaded", "bytes": n}``;
* ``quit`` — close the trainer (every tensor copied out, every page back) and exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvpool.client_lib.errors import StepDeadline, StepTooLarge
from kvpool.client_lib.trainer import connect_trainer


def say(**msg: object) -> None:
    print(json.dumps(msg), flush=True)


def in_arena(t: torch.Tensor, arena) -> bool:  # noqa: ANN001
    base = arena.group.bases[0]
    return base <= t.data_ptr() < base + arena.capacity


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--name", default="trainer")
    ap.add_argument("--wait-s", type=float, default=20.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--shares", type=float, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tr = connect_trainer(args.name, run_dir=args.run_dir, wait_s=args.wait_s,
                         shares=args.shares)
    model = tr.put_module(torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 1)))
    opt = tr.put_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(128, 32)
    y = x[:, :4].sum(1, keepdim=True)
    say(event="ready", state=tr.state.footprint, optim=tr.optim.footprint)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "train":
            nbytes, steps = int(cmd[1]), int(cmd[2])
            losses = []
            try:
                with tr.step(nbytes) as step:
                    scratch = step.empty((nbytes // 4,), torch.float32)
                    scratch.fill_(1.0)  # the step's pages are really there
                    for _ in range(steps):
                        loss = ((model(x) - y) ** 2).mean()
                        loss.backward()
                        opt.step()
                        tr.zero_grad()
                        losses.append(loss.item())
                    p0 = next(model.parameters())
                    say(event="trained", loss=losses, in_pool=in_arena(p0, tr.state)
                        and in_arena(p0.grad, tr.state)
                        and in_arena(opt.state[p0]["exp_avg"], tr.optim))
                    del scratch
                    sys.stdin.readline()
            except (StepDeadline, StepTooLarge) as e:
                say(event="refused", error=type(e).__name__, message=e.message)
                continue
            say(event="ended")
        elif cmd[0] == "hold":
            with tr.step(int(cmd[1])):
                say(event="in_step")
                while True:
                    time.sleep(1)
        elif cmd[0] == "offload":
            say(event="offloaded", bytes=tr.offload())
        elif cmd[0] == "quit":
            tr.close()
            say(event="closed")
            return 0
    tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
