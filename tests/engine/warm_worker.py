"""One bundled engine process for the warm-restart tests with in-flight requests: an
elastic engine with the prefix cache on a real daemon, driven by JSON lines on stdin;
prints one JSON object per line on stdout (``{"event": ...}``).

Commands:
  start    {reqs: [{id, prompt, params}], steps}: queue the requests, take ``steps``
           steps; prints ``started`` with each request's state (``state``: waiting,
           prefill or decode; output tokens so far).
  export   {to, ttl}: detach every request and offer them with the cache to ``to``;
           prints ``cache`` (the message, the units offered), then ``settled`` (state,
           the group's mapped units) and, unless claimed, runs every request to its end
           here and prints ``done`` ({id: output tokens}).
  import   {cache, hold}: adopt the cache and its requests; prints ``adopted``
           (entries, requests, running) or ``refused`` (the error); with ``hold`` stop
           there (to be killed); else run them to the end and print ``done``.
  check    engine and pool integrity; prints ``ok`` with the used block count.
"""

from __future__ import annotations

import json
import time


from worker_loop import arguments, emit, finish_all, integrity, serve  # noqa: E402 (a sibling)


def phase(req) -> str:
    if req.num_computed_tokens == 0:
        return "waiting"
    return "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode"


def start(engine, msg) -> None:
    from kvpool.engine import SamplingParams

    for r in msg["reqs"]:
        engine.add_request(r["prompt"], SamplingParams(**r["params"]), r["id"])
    for _ in range(msg["steps"]):
        engine.step()
    emit(event="started", reqs={rid: {"state": phase(r), "out": r.output_token_ids}
                                for rid, r in engine.requests.items()})


def export(engine, msg) -> None:
    from kvpool.engine_adapters.bundled import handoff_cache

    ttl = msg.get("ttl", 10.0)
    c, ticket = handoff_cache.offer_cache(engine, msg["to"], ttl, in_flight=True)
    emit(event="cache", cache=json.loads(c.to_json()),
         units=engine.pool.allocator.units_of(c.chunks))
    state = handoff_cache.settle_cache(engine, c, ticket, ttl + 10)
    emit(event="settled", state=state, mapped=sorted(engine.pool.allocator.group.mapped),
         detached=len(engine.detached), requests=len(engine.requests),
         integrity=integrity(engine))
    if state != "claimed":
        engine.check_integrity()
        emit(event="done", tokens=finish_all(engine))


def adopt(engine, msg) -> None:
    from kvpool.engine_adapters.bundled import handoff_cache

    try:
        n = handoff_cache.adopt_cache(engine, handoff_cache.CacheHandover.from_json(msg["cache"]))
    except Exception as e:  # noqa: BLE001 - reported to the test
        engine.check_integrity()
        return emit(event="refused", error=f"{type(e).__name__}: {e}",
                    used=engine.pool.num_used_blocks, requests=len(engine.requests))
    engine.check_integrity()
    emit(event="adopted", entries=n, requests=sorted(engine.requests),
         running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting))
    if msg.get("hold"):
        while True:
            time.sleep(1)
    emit(event="done", tokens=finish_all(engine))


def main() -> None:
    ap = arguments()
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    from kvpool.engine import Engine, EngineConfig
    from kvpool.engine_adapters.bundled import Settings, enable

    cfg = EngineConfig(model=args.model, kv_cache_size=args.kv,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    # local weights: the tests count the pool's granted bytes as KV alone
    bridge = enable(cfg, Settings(run_dir=args.run_dir, name=args.name, idle_timeout_s=600.0,
                                  weights="local"))
    engine = Engine(bridge.config, bridge.seams)
    serve(engine, {"start": start, "export": export, "import": adopt})


if __name__ == "__main__":
    main()
