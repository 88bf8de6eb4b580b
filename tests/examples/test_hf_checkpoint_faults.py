"""Corrupt and hostile checkpoints through ``examples/hf_causal_lm.py`` (issue 35).

A tiny Llama directory is written by hand (``config.json`` and ``safetensors`` files made
by the ``safetensors`` library; the tensor names and shapes spelled out below, not taken
from the example) and then damaged: the files, the config's fields, the sharded index,
the generation config, the tokenizer, the command line's arguments. Each damage must be
a :class:`CheckpointError` (a ``ValueError``) whose message names the file and the
tensor or field, raised before anything large is allocated (``tracemalloc`` peak, which
NumPy reports to, while loading); on the command line it is exit status 1 and one line
on stderr, never a traceback, never exit 0.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from _scripts import ROOT, load_script

st = pytest.importorskip("safetensors.numpy")

hf = load_script("examples/hf_causal_lm.py")
CheckpointError = hf.CheckpointError

CONFIG = {
    "model_type": "llama",
    "vocab_size": 16,
    "hidden_size": 8,
    "intermediate_size": 12,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 2,
}


def shapes() -> dict[str, tuple[int, ...]]:
    """A Llama's tensors for CONFIG, as transformers names them."""
    out = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,)}
    out["lm_head.weight"] = (16, 8)
    for i in range(2):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (8,),
                p + "post_attention_layernorm.weight": (8,),
                p + "self_attn.q_proj.weight": (8, 8),
                p + "self_attn.k_proj.weight": (4, 8),
                p + "self_attn.v_proj.weight": (4, 8),
                p + "self_attn.o_proj.weight": (8, 8),
                p + "mlp.gate_proj.weight": (12, 8),
                p + "mlp.up_proj.weight": (12, 8),
                p + "mlp.down_proj.weight": (8, 12),
            }
        )
    return out


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes().items()}


def write_dir(d: Path, *, sharded: bool = False, config=None, state=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    state = tensors() if state is None else state
    if not sharded:
        st.save_file(state, str(d / "model.safetensors"))
        return d
    names = sorted(state)
    half = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, group in half.items():
        st.save_file({n: state[n] for n in group}, str(d / shard))
        weight_map.update(dict.fromkeys(group, shard))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


# -- damage ---------------------------------------------------------------------------------
def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def config_with(**changes):
    def damage(d: Path) -> None:
        config = {**CONFIG, **changes}
        for k, v in changes.items():
            if v is _DROP:
                del config[k]
        (d / "config.json").write_text(json.dumps(config))

    return damage


_DROP = object()


def state_with(change):
    def damage(d: Path) -> None:
        state = tensors()
        change(state)
        st.save_file(state, str(d / "model.safetensors"))

    return damage


def _set(name, value):
    return lambda s: s.__setitem__(name, value)


def _nan(s):
    s["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan


def _cut(n_bytes):
    def damage(d: Path) -> None:
        p = d / "model.safetensors"
        p.write_bytes(p.read_bytes()[:n_bytes])

    return damage


def _prefix(value):
    def damage(d: Path) -> None:
        p = d / "model.safetensors"
        raw = p.read_bytes()
        p.write_bytes(struct.pack("<Q", value) + raw[8:])

    return damage


def _flip_header_byte(d: Path) -> None:
    p = d / "model.safetensors"
    raw = bytearray(p.read_bytes())
    at = 8 + raw[8:].index(b"model.norm")
    raw[at : at + 2] = b"\xc3("  # an invalid UTF-8 sequence
    p.write_bytes(bytes(raw))


def _lying_shape(d: Path) -> None:
    p = d / "model.safetensors"
    header, data = _header(p)
    header["model.norm.weight"]["shape"] = [10**9, 10**9]
    _write_header(p, header, data)


def _raw_config(raw: bytes):
    return lambda d: (d / "config.json").write_bytes(raw)


def _gen_config(raw: bytes):
    return lambda d: (d / "generation_config.json").write_bytes(raw)


# (label, damage, regex of the message, the file it must name)
CASES = [
    # the safetensors file
    (
        "cut in header",
        _cut(40),
        r"header length prefix says \d+ bytes but only",
        "model.safetensors",
    ),
    ("cut in data", _cut(-5), r"past the end of the data region", "model.safetensors"),
    ("prefix 2**60", _prefix(2**60), r"says 1152921504606846976 bytes", "model.safetensors"),
    ("header bit flip", _flip_header_byte, r"not valid UTF-8|not valid JSON", "model.safetensors"),
    ("declared 10**18 elements", _lying_shape, r"'model.norm.weight': shape", "model.safetensors"),
    # tensors against the config
    (
        "wrong shape",
        state_with(_set("model.layers.0.self_attn.k_proj.weight", np.zeros((8, 8), np.float32))),
        r"'model.layers.0.self_attn.k_proj.weight' has shape \(8, 8\), expected \(4, 8\)",
        "model.safetensors",
    ),
    (
        "wrong dtype",
        state_with(_set("model.norm.weight", np.ones(8, np.int32))),
        r"'model.norm.weight' has dtype I32, expected a floating",
        "model.safetensors",
    ),
    (
        "missing tensor",
        state_with(lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
        r"no tensor 'model.layers.1.mlp.up_proj.weight'",
        "config.json",
    ),
    (
        "unused tensor",
        state_with(_set("model.extra", np.zeros(2, np.float32))),
        r"does not use: \['model.extra'\]",
        "model.safetensors",
    ),
    (
        "extra layer",
        state_with(_set("model.layers.2.input_layernorm.weight", np.ones(8, np.float32))),
        r"belongs to layer 2.*num_hidden_layers is 2",
        "model.safetensors",
    ),
    (
        "NaN weight",
        state_with(_nan),
        r"'model.layers.1.mlp.up_proj.weight' holds 1 non-finite.*\(3, 4\)",
        "model.safetensors",
    ),
    (
        "Inf weight",
        state_with(lambda s: s["model.norm.weight"].__setitem__(0, np.inf)),
        r"'model.norm.weight' holds 1 non-finite",
        "model.safetensors",
    ),
    # config.json
    (
        "config missing field",
        config_with(hidden_size=_DROP),
        r"required field 'hidden_size' is missing",
        "config.json",
    ),
    (
        "config negative",
        config_with(num_attention_heads=-2),
        r"num_attention_heads is int -2, expected an int >= 1",
        "config.json",
    ),
    ("config zero head_dim", config_with(head_dim=0), r"head_dim is int 0", "config.json"),
    ("config string size", config_with(hidden_size="8"), r"hidden_size is str '8'", "config.json"),
    ("config float size", config_with(vocab_size=16.0), r"vocab_size is float 16.0", "config.json"),
    (
        "config bool size",
        config_with(num_hidden_layers=True),
        r"num_hidden_layers is bool True",
        "config.json",
    ),
    (
        "config NaN eps",
        config_with(rms_norm_eps=float("nan")),
        r"rms_norm_eps is float nan",
        "config.json",
    ),
    (
        "heads not dividing",
        config_with(num_attention_heads=3, num_key_value_heads=1),
        r"hidden_size=8 is not divisible by num_attention_heads=3",
        "config.json",
    ),
    (
        "kv heads not dividing",
        config_with(num_key_value_heads=3, num_attention_heads=2, head_dim=4),
        r"num_attention_heads=2 is not a multiple of num_key_value_heads=3",
        "config.json",
    ),
    (
        "10**9 layers",
        config_with(num_hidden_layers=10**9),
        r"num_hidden_layers is 1000000000 but",
        "config.json",
    ),
    (
        "10**12 vocab",
        config_with(vocab_size=10**12),
        r"'(lm_head|model.embed_tokens).weight' has shape \(16, 8\), expected \(10{12}, 8\)",
        "model.safetensors",
    ),
    (
        "unknown rope type",
        config_with(rope_scaling={"rope_type": "wavy", "factor": 2.0}),
        r"rope_type must be one of .*'wavy'",
        "config.json",
    ),
    (
        "rope missing key",
        config_with(rope_scaling={"rope_type": "linear"}),
        r"needs rope_scaling\['factor'\]",
        "config.json",
    ),
    ("rope_theta string", config_with(rope_theta="1e4"), r"rope_theta is str", "config.json"),
    (
        "layer_types length",
        config_with(layer_types=["full_attention"], sliding_window=4),
        r"layer_types must be a list of num_hidden_layers=2",
        "config.json",
    ),
    (
        "layer_types unknown",
        config_with(layer_types=["full_attention", "chunky"]),
        r"layer_types holds \['chunky'\]",
        "config.json",
    ),
    (
        "unknown activation",
        config_with(hidden_act="relu7"),
        r"hidden_act 'relu7' is not supported",
        "config.json",
    ),
    (
        "eos not an int",
        config_with(eos_token_id="</s>"),
        r"eos_token_id is '</s>', expected",
        "config.json",
    ),
    (
        "model_type",
        config_with(model_type="gpt2"),
        r"model_type must be one of .*'gpt2'",
        "config.json",
    ),
    (
        "quantized",
        config_with(quantization_config={"quant_method": "mxfp4"}),
        r"quantized",
        "config.json",
    ),
    (
        "config not JSON",
        _raw_config(b'{"model_type": "llama",'),
        r"not valid JSON \(.*line 1",
        "config.json",
    ),
    (
        "config not UTF-8",
        _raw_config(b'{"model_type": "ll\xe9ama"}'),
        r"not valid UTF-8 \(byte 18",
        "config.json",
    ),
    ("config a list", _raw_config(b"[1, 2]"), r"expected a JSON object", "config.json"),
    (
        "config duplicate key",
        _raw_config(json.dumps(CONFIG).encode()[:-1] + b', "hidden_size": 16}'),
        r"key 'hidden_size' appears twice",
        "config.json",
    ),
    (
        "generation_config corrupt",
        _gen_config(b"\x00\x01"),
        r"not valid JSON",
        "generation_config.json",
    ),
    (
        "generation_config eos",
        _gen_config(b'{"eos_token_id": [1, 2.5]}'),
        r"eos_token_id is \[1, 2.5\]",
        "generation_config.json",
    ),
]


@pytest.mark.parametrize("label, damage, pattern, file", CASES, ids=[c[0] for c in CASES])
def test_hostile_checkpoint_is_a_clear_error_before_allocating(
    tmp_path, label, damage, pattern, file
):
    d = write_dir(tmp_path / "ckpt")
    damage(d)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            hf.CausalLM.from_pretrained(d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert re.search(pattern, message), message
    assert str(d / file) in message, message
    assert not isinstance(info.value, (KeyError, MemoryError, UnicodeError, IndexError))
    assert peak < 8 * 2**20, f"{label}: {peak} bytes allocated before the error"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_good_directory_loads_and_nonfinite_can_be_allowed(tmp_path):
    """The undamaged directory (single file and sharded) loads to the same logits as
    from_state on the arrays; a NaN weight loads with check_finite=False."""
    state = tensors()
    ids = np.array([[1, 2, 3]])
    ref = np.asarray(hf.CausalLM.from_state(CONFIG, state)(ids))
    for sharded in (False, True):
        d = write_dir(tmp_path / f"ok{sharded}", sharded=sharded)
        np.testing.assert_array_equal(np.asarray(hf.CausalLM.from_pretrained(d)(ids)), ref)
    d = write_dir(tmp_path / "nan")
    state_with(_nan)(d)
    model = hf.CausalLM.from_pretrained(d, check_finite=False)
    assert np.isnan(np.asarray(model.layers[1]["up_proj"])[3, 4])
    with pytest.raises(CheckpointError, match=r"checkpoint tensor 'model.norm.weight' holds"):
        hf.CausalLM.from_state(CONFIG, {**state, "model.norm.weight": np.full(8, np.inf)})
    # finite float32 weights beyond float16's range: refused when loaded as float16
    big = write_dir(
        tmp_path / "big", state={**state, "model.norm.weight": np.full(8, 1e6, np.float32)}
    )
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' .* beyond float16's range"):
        hf.CausalLM.from_pretrained(big, dtype=np.float16)
    assert hf.CausalLM.from_pretrained(big).params["norm"].dtype == np.float32


def test_sharded_index_pointing_outside_is_refused_before_reading(tmp_path):
    d = write_dir(tmp_path / "ckpt", sharded=True)
    index = d / "model.safetensors.index.json"
    outside = tmp_path / "outside.safetensors"
    st.save_file({"model.norm.weight": np.ones(8, np.float32)}, str(outside))
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map["model.norm.weight"] = "../outside.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    before = os.stat(outside)
    with pytest.raises(
        CheckpointError, match=r"'../outside.safetensors' is not a relative path"
    ) as e:
        hf.load_model_dir(d)
    assert str(e.value).startswith(str(index))
    assert os.stat(outside).st_mtime_ns == before.st_mtime_ns
    # a symlinked config.json out of the directory is refused too
    d2 = write_dir(tmp_path / "ckpt2")
    (d2 / "config.json").unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(CONFIG))
    (d2 / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match=r"'config.json' resolves to .*outside"):
        hf.load_model_dir(d2)


# -- the command line ------------------------------------------------------------------------
def run_cli(*args: str, timeout: float = 90.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_command_line_reports_one_line_and_fails(tmp_path):
    """Damaged directories through the script itself (a subprocess, with a timeout):
    exit status 1, one line on stderr naming the file, no traceback, nothing on stdout;
    --debug shows the traceback."""
    bad = write_dir(tmp_path / "bad", sharded=True)
    index = bad / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map["model.norm.weight"] = "/etc/passwd"
    index.write_text(json.dumps({"weight_map": weight_map}))
    cut = write_dir(tmp_path / "cut")
    _cut(30)(cut)
    field = write_dir(tmp_path / "field")
    config_with(num_key_value_heads=0)(field)
    base = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--no-progress"]
    for d, what, pattern in (
        (bad, "model.safetensors.index.json", r"'/etc/passwd' is not a relative path"),
        (cut, "model.safetensors", r"header length prefix says"),
        (field, "config.json", r"num_key_value_heads is int 0, expected an int >= 1"),
    ):
        run = run_cli("--model-dir", str(d), *base)
        assert run.returncode == 1, (what, run.returncode, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
        assert lines[0].startswith(f"hf_causal_lm.py: error: {d / what}: "), lines[0]
        assert re.search(pattern, lines[0]), lines[0]
        assert run.stdout == ""
    debug = run_cli("--model-dir", str(cut), *base, "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert "CheckpointError" in debug.stderr


def test_command_line_arguments_that_cannot_work(tmp_path, capsys):
    """In process: the undamaged directory exits 0; a prompt id outside the vocabulary,
    --max-new-tokens below 1 or beyond memory, a bad --top-p are argument errors (status
    2, argparse's message), found before the cache is allocated."""
    good = write_dir(tmp_path / "good")
    base = ["--model-dir", str(good), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    assert hf.cli([*base, "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("1,2,3 -> ")
    for args, pattern in (
        (["--max-new-tokens", "0"], r"--max-new-tokens must be >= 1, got 0"),
        (["--prompt-ids", "1,16"], r"token id 16 of prompt 0 is outside the vocabulary \[0, 16\)"),
        (["--prompt-ids", "-1"], r"token id -1 of prompt 0 is outside the vocabulary"),
        (["--max-new-tokens", str(10**15)], r"--max-new-tokens 1000000000000000: the KV cache"),
        (["--top-p", "nan"], r"--top-p must be in \(0, 1\], got nan"),
        (["--temperature", "-1"], r"--temperature must be a finite number >= 0"),
        (["--prompt-ids", "1,x"], r"--prompt-ids must be comma-separated ints, .* got '1,x'"),
    ):
        tracemalloc.start()
        try:
            with pytest.raises(SystemExit) as e:
                hf.main([*base, *args])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert e.value.code == 2
        assert re.search(pattern, capsys.readouterr().err), args
        assert peak < 8 * 2**20, (args, peak)
    # an error from Python is one line through cli(), status 1
    assert hf.cli(["--model-dir", str(tmp_path / "none"), "--prompt-ids", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FileNotFoundError" in err[0] and "config.json" in err[0]


def test_prompt_ids_and_tokenizer_faults(tmp_path):
    for text, pattern in (
        ("1,x;2", r"--prompt-ids must be comma-separated ints"),
        ("9" * 5000, r"--prompt-ids must be comma-separated ints"),
        (";;", r"--prompt-ids holds no prompt"),
    ):
        with pytest.raises(ValueError, match=pattern):
            hf.parse_prompt_ids(text)
    d = write_dir(tmp_path / "tok")
    (d / "tokenizer.json").write_bytes(b"\x89PNG not a tokenizer")
    pytest.importorskip("tokenizers")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: not a tokenizer file") as e:
        hf.main(["--model-dir", str(d), "--prompt", "hello"])
    assert str(d / "tokenizer.json") in str(e.value)


def test_command_line_reports_the_checkpoint_before_the_prompts(tmp_path, capsys):
    """Without prompts or a tokenizer a broken directory still reports the checkpoint's
    problem (it is inspected first, headers only), not the missing --prompt-ids."""
    d = write_dir(tmp_path / "ckpt")
    config_with(num_hidden_layers=10**9)(d)
    assert hf.cli(["--model-dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert str(d / "config.json") in err and "num_hidden_layers is 1000000000" in err
    config, headers = hf.inspect_model_dir(write_dir(tmp_path / "ok"))
    assert config["num_hidden_layers"] == 2 and headers["model.norm.weight"].shape == (8,)


def test_token_ids_outside_the_vocabulary_load_as_in_transformers(tmp_path):
    """Old LLaMA configs carry ``pad_token_id: -1`` and some EOS lists name ids beyond the
    embedding: transformers loads them (the ids are never looked up in the embedding), so
    the runner does too, and pads finished rows with such an id as generate() would."""
    d = write_dir(tmp_path, config={**CONFIG, "pad_token_id": -1, "eos_token_id": [2, 10**6]})
    config, _ = hf.inspect_model_dir(d)
    special = hf.generation_token_ids(config, d)
    assert special["pad_token_id"] == -1 and special["eos_token_id"] == [2, 10**6]
