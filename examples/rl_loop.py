"""A reinforcement-learning loop colocated on one kvpool budget: copy and adapt.

The rollout engine is an elastic ``kvpool serve`` with its weights in the pool; this
process is a trainer tenant whose policy, gradients and Adam state live in pool pages.
Each step: rollouts through the engine's OpenAI API, the trainer's step memory granted
(the daemon takes the idle engine's KV; its weights stay), a GRPO update, the new weights
published in place: the policy's parameters are the engine's weights (a mutable weight
set the update writes into its back buffer; ``POST /kvpool/weights {"mutable": ...}``
makes the engine remap to the new version, no byte copied), or, when the layouts differ
(a bf16 engine), by a checkpoint the engine loads.

    RUN=/tmp/kvpool-rl; MODEL=/tmp/tiny-policy
    kvpool make-model $MODEL                                     # a tiny checkpoint
    # (or SmolLM2: kvpool make-model --from-gguf smollm2 $MODEL, a budget of 4GiB on
    # 2MiB pages, --lr 1e-5; or a vLLM engine: KVPOOL_ENABLE=1 KVPOOL_RUN_DIR=$RUN python
    # -m vllm.entrypoints.openai.api_server --model $MODEL --served-model-name engine
    # --dtype float32, then --engine-tenant engine)
    kvpool daemon --run-dir $RUN --budget 16MiB --page-size 64KiB &
    KVPOOL_RUN_DIR=$RUN KVPOOL_IDLE_TIMEOUT=3600 kvpool serve $MODEL --elastic \\
        --weights pool --served-model-name engine --port 8000 --kv-cache-size 16MiB &
    python examples/rl_loop.py --run-dir $RUN --url http://127.0.0.1:8000 --model $MODEL

``kvpool demo --scenario train`` does all of this for you (and draws the memory chart).
The pieces to change for your task: :class:`kvpool.demo.rl_loop.LoopConfig` (prompts,
samples, reward) and :meth:`kvpool.demo.rl_loop.Loop.reward`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpool.client_lib import Monitor
from kvpool.client_lib.trainer import connect_trainer
from kvpool.demo.rl_loop import KvSwitch, Loop, LoopConfig
from kvpool.sizes import parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description="an RL loop on one kvpool budget")
    ap.add_argument("--run-dir", required=True, help="the daemon's run dir")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the engine")
    ap.add_argument("--served-name", default="engine", help="the engine's model name")
    ap.add_argument("--model", required=True, type=Path, help="the checkpoint it serves")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=None,
                    help="Adam's learning rate [the loop's, 1e-2, chosen on the tiny model; "
                    "SmolLM2: 1e-5]")
    ap.add_argument("--engine-tenant", default=None,
                    help="the engine's tenant name in `kvpool ps` [the one with pool "
                    "weights; a vLLM engine (weights in its own memory): its name]")
    ap.add_argument("--engine-keep", default="256KiB",
                    help="KV the engine keeps while the trainer steps")
    ap.add_argument("--out", type=Path, default=Path("rl-out"))
    args = ap.parse_args()
    try:
        keep = parse_size(args.engine_keep)
    except ValueError as e:
        ap.error(str(e))  # one line, exit 2
    with Monitor(args.run_dir) as mon, \
            connect_trainer("trainer", run_dir=args.run_dir, shares=64, wait_s=60) as tr:
        pool = mon.ps().pool
        tenants = mon.ps().tenants
        engine = next((t for t in tenants if (t.name == args.engine_tenant
                                               if args.engine_tenant else t.weights)), None)
        if engine is None or pool is None:
            print(f"no engine {args.engine_tenant or 'with pool weights'} on this daemon",
                  file=sys.stderr)
            return 1

        held = {"weights": engine.weights}

        def step_bytes(trainer: object) -> int:  # all but the engine's weights and keep
            n = pool.budget - held["weights"] - tr.held_bytes - keep
            return n - n % pool.page_size

        cfg = LoopConfig(steps=args.steps)
        if args.lr is not None:
            cfg.lr = args.lr
        loop = Loop(cfg, args.url, args.served_name, args.model,
                    tr, mon, KvSwitch(args.url, step_bytes), args.out / "checkpoints",
                    on_step=lambda r: print(json.dumps({
                        "step": r.step, "reward": round(r.reward, 3),
                        "rollout_s": round(r.rollout_s, 3), "train_s": round(r.train_s, 3),
                        "switch_s": round(r.to_train_s + r.to_rollout_s, 3),
                        "publish_s": round(r.publish_s, 3), "weights_copied": r.weights_copied,
                        "engine_kv_while_training": r.held_train.get(engine.name, {})
                        .get("mapped")}), flush=True),
                    in_place=engine.weights > 0)  # (a vLLM engine: by checkpoint)
        # in place the engine's weights are the mutable set (two buffers)
        held["weights"] = {t.name: t.weights for t in mon.ps().tenants}[engine.name]
        print(f"publishing {'in place' if loop.inplace else 'by checkpoint'}"
              f"{'' if loop.inplace else ': ' + loop.in_place_why}", flush=True)
        try:
            loop.run()
        finally:
            loop.close()
        print(f"kvpool check: {mon.check() or 'clean'}")
    return 0


if __name__ == "__main__":
    from kvpool.client_lib import KvpoolError

    try:
        sys.exit(main())
    except KvpoolError as e:  # a step not granted by its deadline, say: one line
        print(f"rl_loop: {e}", file=sys.stderr)
        sys.exit(1)
