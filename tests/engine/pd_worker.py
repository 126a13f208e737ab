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
           the pages at), or ``refused``; with ``hold`` stop there (to be killed), else
           decode to the end and print ``done``.
  check    engine and pool integrity; prints ``ok`` with the used block count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


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
    emit(event="done", id=h.request_id, tokens=finish(engine, h.request_id))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--kv", default="2MiB")
    args = ap.parse_args()
    from kvpool.engine import Engine, EngineConfig
    from kvpool.engine_adapters.bundled import Settings, enable

    cfg = EngineConfig(model=args.model, kv_cache_size=args.kv)
    enable(cfg, Settings(run_dir=args.run_dir, name=args.name, request_aligned=True,
                         idle_timeout_s=1.0))
    engine = Engine(cfg)
    emit(event="ready")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "prefill":
                prefill(engine, msg)
            elif msg["cmd"] == "decode":
                decode(engine, msg)
            elif msg["cmd"] == "check":
                engine.check_integrity()
                emit(event="ok", used=engine.pool.num_used_blocks)
        except Exception as e:  # noqa: BLE001
            emit(event="error", error=f"{type(e).__name__}: {e}",
                 trace=traceback.format_exc())
    engine.close()


if __name__ == "__main__":
    main()
