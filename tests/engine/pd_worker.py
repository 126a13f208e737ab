"""One bundled engine process for the prefill/decode handoff tests: an elastic,
request-aligned engine on a real daemon, driven by JSON lines on stdin; prints one JSON
object per line on stdout (``{"event": ...}``).

Commands:
  prefill  {id, prompt, params, to, ttl}: run the request until its first token; if it
           finished, print ``done``; else offer its KV to ``to`` and print ``handover``
           (the message for the decode side), then wait for the ticket and print
           ``settled`` (state, the group's mapped units); a request whose ticket did not
           get claimed runs on here and prints ``done``.
  decode   {handover, hold}: claim the request and print ``claimed`` (the units it mapped
           the pages at), or ``refused``; with ``hold`` stop there (to be killed), with
           ``pause`` wait for a line on stdin; then decode to the end and print ``done``.
  check    engine and pool integrity; prints ``ok`` with the used block count.
  run      {id, prompt, params}: run a request here to the end; ``done`` (with its
           prefix-cache hit tokens).
  export   {to, ttl}: (warm restart, idle) offer the prefix cache to ``to``; prints
           ``cache`` (the message for the new engine, the units), then ``settled``.
  import   {cache}: adopt the cache; prints ``adopted`` (entries) or ``refused``.
  probe    {prompt}: the prefix-cache hit the prompt would get now (``hit``, tokens);
           changes nothing.

``--no-aligned`` runs the engine with the prefix cache instead of request-aligned KV.
"""

from __future__ import annotations

import json
import sys
import time


from worker_loop import arguments, emit, integrity, serve  # noqa: E402 (a sibling module)


def finish(engine, rid: str) -> list[int]:
    while True:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o.output_token_ids


def prefill(engine, msg) -> None:
    from kvpool.engine import SamplingParams
    from kvpool.engine_adapters.bundled import handoff

    rid = msg["id"]
    engine.add_request(msg["prompt"], SamplingParams(**msg["params"]), rid)
    while True:
        outs = {o.request_id: o for o in engine.step()}
        if rid in outs and outs[rid].new_token_ids:
            break
    if outs[rid].finished:
        return emit(event="done", id=rid, tokens=outs[rid].output_token_ids)
    h, ticket = handoff.give(engine, rid, to=msg["to"], ttl_s=msg.get("ttl", 10.0))
    alloc = engine.pool.allocator
    emit(event="handover", handover=json.loads(h.to_json()),
         units=alloc.units_of(h.chunks))
    state = handoff.settle(engine, h, ticket, msg.get("ttl", 10.0) + 10)
    engine.check_integrity()
    emit(event="settled", id=rid, state=state, mapped=sorted(alloc.group.mapped))
    if state != "claimed":
        emit(event="done", id=rid, tokens=finish(engine, rid))


def decode(engine, msg) -> None:
    from kvpool.engine_adapters.bundled import handoff

    h = handoff.Handover.from_json(msg["handover"])
    try:
        handoff.take(engine, h)
    except Exception as e:  # noqa: BLE001 - reported to the test
        engine.check_integrity()
        return emit(event="refused", error=f"{type(e).__name__}: {e}")
    pool = engine.pool
    emit(event="claimed", id=h.request_id,
         units=pool.allocator.units_of(pool.request_chunks(h.request_id)),
         block_ids=engine.requests[h.request_id].block_ids)
    if msg.get("hold"):
        while True:
            time.sleep(1)
    if msg.get("pause"):
        sys.stdin.readline()  # the test looks at the daemon's map first
    emit(event="done", id=h.request_id, tokens=finish(engine, h.request_id))


def run(engine, msg) -> None:
    from kvpool.engine import SamplingParams

    rid = msg["id"]
    engine.add_request(msg["prompt"], SamplingParams(**msg["params"]), rid)
    while True:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return emit(event="done", id=rid, tokens=o.output_token_ids,
                            hit=o.num_prefix_hit_tokens)


def export(engine, msg) -> None:
    from kvpool.engine_adapters.bundled import handoff_cache

    c, ticket = handoff_cache.offer_cache(engine, msg["to"], msg.get("ttl", 10.0))
    emit(event="cache", cache=json.loads(c.to_json()),
         units=engine.pool.allocator.units_of(c.chunks))
    state = handoff_cache.settle_cache(engine, c, ticket, msg.get("ttl", 10.0) + 10)
    emit(event="settled", state=state, mapped=sorted(engine.pool.allocator.group.mapped),
         integrity=integrity(engine))


def adopt(engine, msg) -> None:
    from kvpool.engine_adapters.bundled import handoff_cache

    try:
        n = handoff_cache.adopt_cache(engine, handoff_cache.CacheHandover.from_json(msg["cache"]))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return emit(event="refused", error=f"{type(e).__name__}: {e}")
    engine.check_integrity()
    emit(event="adopted", entries=n, cached=engine.pool.num_cached_blocks)


def probe(engine, msg: dict) -> None:
    from kvpool.engine import SamplingParams
    from kvpool.engine.request import Request

    req = Request("probe", msg["prompt"], SamplingParams(), None)
    emit(event="hit", tokens=engine.kv_manager.get_computed_blocks(req)[1])


def main() -> None:
    ap = arguments()
    ap.add_argument("--no-aligned", dest="aligned", action="store_false")
    args = ap.parse_args()
    from kvpool.engine import Engine, EngineConfig
    from kvpool.engine_adapters.bundled import Settings, enable

    cfg = EngineConfig(model=args.model, kv_cache_size=args.kv)
    # local weights: the tests count the pool's granted bytes as KV alone
    settings = Settings(run_dir=args.run_dir, name=args.name, request_aligned=args.aligned,
                        idle_timeout_s=600.0 if not args.aligned else 1.0,  # keep the cache
                        weights="local")
    bridge = enable(cfg, settings)
    engine = Engine(bridge.config, bridge.seams)
    serve(engine, {"prefill": prefill, "decode": decode, "run": run, "export": export,
                   "import": adopt, "probe": probe})


if __name__ == "__main__":
    main()
