"""The exit matrix (issue 61 §1): every way a swapped model leaves our code and comes back.

Each row is EQUAL to the unswapped path (the saved model's logits, ``torch.equal``; ``allclose`` only
where the host path itself runs other arithmetic, said in the row) or REFUSED before anything is
built. Rows that an existing test already holds are not repeated here: docs/exits.md lists every
row with the test node that checks it, and :func:`test_every_test_named_in_docs_exits_exists` keeps
that page honest. A row marked ``xfail(strict=True, reason="new: ...")`` is a silent exit still open
(docs/exits.md says which): it turns red the day it is closed, so its mark goes with the fix.
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.exits import (CASES, COPIES, GRAPHS, LOADERS, PLAIN_FORMULA, REFUSED, Built, Logits, build, close,
                           equal_or_refused, logits_of, named_tests, small_net, swap, trained)
from helpers.hf import tiny_causal_lm, tiny_config, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms

ROOT = Path(__file__).resolve().parents[1]
slow = pytest.mark.slow
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning",
                                        "ignore::torch.jit.TracerWarning")


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.utils.logging.enable_progress_bar()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(case)``: the case built and saved once per module (see helpers/exits.py)."""
    root, cache = tmp_path_factory.mktemp("exits"), {}

    def get(case: str) -> Built:
        if case not in cache:
            cache[case] = build(case, root)
        return cache[case]

    return get


# ---- save_pretrained + a loader: the saved model's logits -------------------------------------------------------


#: (case, loader) rows not held by tests/swap/test_hf_save_format.py and tests/test_pretrained*.py
LOADER_ROWS = [
    *[(case, "auto_trust") for case in ("llama-rms-half", "llama-layer", "llama-dyt", "gemma-mrs", "gemma-rms-half")],
    *[(case, "lightning_mrs") for case in ("llama-dyt", "gemma-rms-half")],
    *[(case, "device_map_cpu") for case in ("llama-dyt", "gemma-rms-half")],
    *[(case, "init_empty_weights") for case in ("llama-mrs", "gemma-rms-half", "qwen3-mrs")],
]


@pytest.mark.parametrize(("case", "loader"), LOADER_ROWS, ids=[f"{c}-{ld}" for c, ld in LOADER_ROWS])
def test_loader(built, case, loader):
    b = built(case)
    assert torch.equal(LOADERS[loader](b), b.logits)


@pytest.mark.parametrize("case", ["llama-dyt", "gemma-rms-half"])
def test_auto_without_trust_remote_code_is_refused(built, case):
    with pytest.raises(ValueError, match=r"contains custom code which must be executed(.|\n)*trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(built(case).path)


def test_another_head_with_trust_remote_code(built):
    """AutoModelForSequenceClassification of a causal LM's directory: the same body (hidden states)."""
    for case in ("gemma-rms-half", "qwen3-mrs"):
        b = built(case)
        head = transformers.AutoModelForSequenceClassification.from_pretrained(b.path, trust_remote_code=True,
                                                                               attn_implementation="eager")
        with torch.no_grad():
            assert torch.equal(head.model(token_batch()).last_hidden_state, b.hidden(token_batch())), case


@pytest.mark.parametrize("variant", ["sharded", "resized_embeddings", "bfloat16"])
def test_save_pretrained_variants(tmp_path, variant):
    """Gemma swapped to rms-half with MRS QK-norms, saved in shards, after ``resize_token_embeddings``, or in
    bfloat16: ``lightning_mrs.from_pretrained`` and the Auto class give its logits (and dtype) back."""
    model = trained(swap(tiny_causal_lm("gemma"), "gemma-rms-half"))
    swap_norms(model, None, qk_norm="mrs")
    if variant == "resized_embeddings":
        model.resize_token_embeddings(80)
    elif variant == "bfloat16":  # transformers' load keeps the rotary buffers in float32, swapped or not
        rotary = {n: b for n, b in model.named_buffers() if "inv_freq" in n}
        model = model.to(torch.bfloat16)
        for name, buffer in rotary.items():
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, buffer)
    model.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if variant == "sharded" else {}))
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 or variant != "sharded"
    expected = logits_of(model)
    for again in (from_pretrained(tmp_path), transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)):
        assert again.dtype == model.dtype and torch.equal(logits_of(again), expected)


#: the family's own maths: its plain class may load these equal (and then must carry no record)
SAME_MATHS = {"llama-rms", "llama-rms-half", "gemma-rms"}
FAMILY_ROWS = list(CASES)


@pytest.mark.parametrize("case", FAMILY_ROWS)
def test_the_familys_own_class(built, tmp_path, case):
    """``LlamaForCausalLM.from_pretrained(d)`` (no remote code): other maths are refused in one line;
    the family's own maths load equal as a plain model whose config has no record, whose save loads plain."""
    b = built(case)
    own = type(b.model).__mro__[1]  # LightningMRSLlamaForCausalLM -> LlamaForCausalLM
    assert own.__module__.startswith("transformers.")
    if case not in SAME_MATHS:
        with pytest.raises(Exception, match=REFUSED) as err:
            own.from_pretrained(b.path)
        assert "\n" not in str(err.value).strip()
        return

    def reloaded(plain: torch.nn.Module) -> torch.Tensor:
        saved = plain.config.to_dict()
        assert plain.config.model_type == b.family and "lightning_mrs" not in saved and not saved.get("auto_map")
        assert torch.equal(logits_of(plain), b.logits)
        plain.save_pretrained(tmp_path)  # a plain directory: transformers opens it without remote code
        return logits_of(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))

    equal_or_refused(lambda: own.from_pretrained(b.path), b.logits, reloaded)


@pytest.mark.parametrize("case", ["llama-dyt", "gemma-rms-half"])
def test_the_familys_own_head_class(built, case):
    """``LlamaForSequenceClassification.from_pretrained(d)``: the family's class of another head."""
    b = built(case)
    head = getattr(transformers, type(b.model).__mro__[1].__name__.replace("CausalLM", "SequenceClassification"))
    with pytest.raises(Exception, match=REFUSED) as err:
        head.from_pretrained(b.path)
    assert "\n" not in str(err.value).strip()


# ---- PEFT: LoRA adapters on the swapped base --------------------------------------------------------------------

PEFT_ROWS = [("llama-mrs", "peft_model"), ("gemma-rms-half", "peft_model"), ("gemma-rms-half", "auto_peft_model"),
             ("qwen3-mrs", "merge_and_unload"),
             ("llama-mrs", "auto_peft_model_no_task_type")]


@pytest.mark.parametrize(("case", "loader"), PEFT_ROWS)
def test_peft(built, tmp_path, case, loader):
    peft = pytest.importorskip("peft")
    b = built(case)
    task = {} if loader.endswith("no_task_type") else dict(task_type="CAUSAL_LM")
    lora = peft.get_peft_model(from_pretrained(b.path, attn_implementation="eager"),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **task))
    lora.save_pretrained(tmp_path)
    expected = logits_of(lora)
    if loader == "merge_and_unload":  # the merged swapped model saves and loads as itself (merging rounds W + BA)
        merged = lora.merge_and_unload()
        assert type(merged) is type(b.model)
        merged.save_pretrained(tmp_path / "merged")
        torch.testing.assert_close(logits_of(merged), expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(logits_of(from_pretrained(tmp_path / "merged", attn_implementation="eager")), logits_of(merged))
        return
    if loader == "peft_model":
        loaded = peft.PeftModel.from_pretrained(from_pretrained(b.path, attn_implementation="eager"), tmp_path)
    else:
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True,
                                                                attn_implementation="eager")
    assert torch.equal(logits_of(loaded), expected)


NEW_PEFT = pytest.mark.xfail(strict=True, reason="new: adapters of a model loaded plain and swapped in memory: "
                                                 "AutoPeftModelForCausalLM rebuilds the plain base, logits off by 0.1")


@pytest.mark.parametrize("order", [pytest.param("swap_then_lora", marks=NEW_PEFT),
                                   pytest.param("lora_then_swap", marks=NEW_PEFT)])
def test_peft_adapters_of_a_base_swapped_in_memory(tmp_path, order):
    """A plain pretrained directory, loaded, swapped and given LoRA (either order), its adapters saved: PEFT's
    auto loader rebuilds the base from ``base_model_name_or_path``, the plain directory. Equal, or refused."""
    peft = pytest.importorskip("peft")
    tiny_causal_lm("llama").save_pretrained(tmp_path / "plain")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="eager")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    if order == "swap_then_lora":
        lora = peft.get_peft_model(trained(swap(base, "llama-mrs")), config)
    else:
        lora = peft.get_peft_model(base, config)
        trained(swap(lora, "llama-mrs"))
    lora.save_pretrained(tmp_path / "adapters")
    equal_or_refused(lambda: peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapters", trust_remote_code=True,
                                                                            attn_implementation="eager"),
                     logits_of(lora), logits_of)


# ---- in memory: state dicts, copies, pickles --------------------------------------------------------------------


#: llama-mrs deepcopy/pickle: tests/swap/test_hf_save_format.py::test_a_swapped_model_pickles_and_copies_as_its_class
COPY_ROWS = [("llama-mrs", "torch_save"), ("llama-mrs", "state_dict"), ("llama-mrs", "pickle_then_save_pretrained"),
             *[(case, how) for case in ("llama-layer", "llama-dyt", "gemma-rms-half", "qwen3-mrs", "llama-qk")
               for how in ("state_dict", "deepcopy", "pickle", "torch_save")]]


@pytest.mark.parametrize(("case", "how"), COPY_ROWS, ids=[f"{c}-{h}" for c, h in COPY_ROWS])
def test_in_memory(built, tmp_path, case, how):
    b = built(case)
    again = COPIES[how](b, tmp_path)
    assert type(again) is type(b.model) or how == "pickle_then_save_pretrained"
    assert [type(m).__name__ for m in again.modules()] == [type(m).__name__ for m in b.model.modules()]
    assert torch.equal(logits_of(again), b.logits)


#: torch's strict load_state_dict into the family's unswapped model: refused by torch where a key or a
#: shape differs, equal where the maths are the family's own
INTO_PLAIN = {"llama-mrs": "refused", "llama-layer": "refused", "llama-dyt": "refused", "qwen3-mrs": "refused",
              "llama-qk": "refused", "llama-rms-half": "equal", "gemma-rms": "equal", "gemma-rms-half": "either"}
TORCH_REFUSES = r"^Error\(s\) in loading state_dict for \w+ForCausalLM"
NEW_STATE_DICT = pytest.mark.xfail(strict=True, reason="new: torch's load_state_dict of a Gemma swapped to rms-half into "
                                                       "GemmaForCausalLM: same keys and shapes, logits off by 0.7")


@pytest.mark.parametrize("case", [pytest.param(c, marks=NEW_STATE_DICT) if c == "gemma-rms-half" else c
                                  for c in INTO_PLAIN])
def test_state_dict_into_the_unswapped_model(built, case):
    b = built(case)
    plain = tiny_causal_lm(b.family, seed=1)
    if INTO_PLAIN[case] == "refused":
        with pytest.raises(RuntimeError, match=TORCH_REFUSES):
            plain.load_state_dict(b.model.state_dict())
        return
    try:
        plain.load_state_dict(b.model.state_dict())
    except RuntimeError as exc:  # the parameters' names or shapes differ: torch's own refusal
        assert INTO_PLAIN[case] == "either" and re.match(TORCH_REFUSES, str(exc)), exc
        return
    assert torch.equal(logits_of(plain), b.logits)


# ---- graphs: export, tracing, compile, ONNX of the swapped transformers model -----------------------------------

#: llama-mrs compile and ONNX in the default suite: tests/ops/test_compile.py, tests/swap/test_onnx.py
GRAPH_ROWS = [("llama-mrs", "export"), ("gemma-rms-half", "export"), ("gemma-rms-half", "jit_trace"),
              *[pytest.param(c, g, marks=slow) for c, g in [
                  ("llama-dyt", "export"), ("qwen3-mrs", "export"), ("llama-qk", "export"), ("llama-mrs", "jit_trace"),
                  ("qwen3-mrs", "jit_trace"), ("gemma-rms-half", "compile"), ("llama-dyt", "compile"),
                  ("qwen3-mrs", "compile"), ("llama-qk", "compile"), ("llama-dyt", "onnx"), ("gemma-rms-half", "onnx"),
                  ("qwen3-mrs", "onnx")]]]


@pytest.mark.parametrize(("case", "graph"), GRAPH_ROWS)
def test_graph(built, tmp_path, case, graph):
    b = built(case)
    with torch.no_grad():
        got = GRAPHS[graph](b, tmp_path)
    if graph == "onnx":  # onnxruntime's own kernels
        torch.testing.assert_close(got, b.logits, atol=1e-5, rtol=1e-4)
    else:
        close(got, b)


@pytest.mark.parametrize("how", ["jit_script", "fx_symbolic_trace"])
def test_a_transformers_model_is_refused_by_the_host_swapped_or_not(how):
    """transformers' decoders neither script nor fx-trace (the host's own error, the same swapped or not)."""
    run = {"jit_script": torch.jit.script, "fx_symbolic_trace": lambda m: torch.fx.symbolic_trace(Logits(m))}[how]
    errors = []
    for case in (None, "llama-mrs"):
        model = tiny_causal_lm("llama")
        with pytest.raises(Exception) as err:
            run(model if case is None else swap(model, case))
        errors.append(type(err.value))
    assert errors[0] is errors[1]


# ---- graphs of a small torch model: fx, TorchScript, export, ONNX per target -----------------------------------

TARGETS = ("mrs", "rms-half", "layer", "dyt")


def _small(target: str) -> tuple[torch.nn.Module, torch.Tensor]:
    net = small_net()
    swap_norms(net, target)
    return trained(net, seed=1), torch.randn(2, 5, 8)


SMALL_EXITS = {"fx": torch.fx.symbolic_trace, "jit_script": torch.jit.script,
               "jit_trace": lambda net: torch.jit.trace(net, torch.randn(2, 5, 8)),
               "export": lambda net: torch.export.export(net, (torch.randn(2, 5, 8),)).module()}
SMALL_ROWS = [(t, e) for t in TARGETS for e in SMALL_EXITS if (t, e) != ("rms-half", "jit_script")]


@pytest.mark.parametrize(("target", "exit_"), SMALL_ROWS, ids=[f"{t}-{e}" for t, e in SMALL_ROWS])
def test_small_net(target, exit_):
    net, x = _small(target)
    expected = net(x)
    got = SMALL_EXITS[exit_](net)(x)
    if target == "mrs" and exit_ != "fx":  # the plain formula (fx keeps the op as one wrapped node)
        torch.testing.assert_close(got, expected, **PLAIN_FORMULA)
    else:
        assert torch.equal(got, expected)


def test_small_net_rms_half_is_refused_by_torchscript():
    """The experimental half-precision layers do not script: TorchScript's compiler refuses (the host's error)."""
    net, _ = _small("rms-half")
    with pytest.raises(RuntimeError, match="cannot statically infer the expected size of a list"):
        torch.jit.script(net)


@pytest.mark.parametrize("target", ["dyt", pytest.param("rms-half", marks=slow)])  # mrs, rms, layer: test_onnx.py
def test_small_net_onnx(target):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    net, x = _small(target)
    program = torch.onnx.export(net, (x,), dynamo=True, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    torch.testing.assert_close(got, net(x), atol=1e-5, rtol=1e-4)  # onnxruntime's own kernels


# ---- swapping after the exit ------------------------------------------------------------------------------------


def _swapped_eager(net: torch.nn.Module, target: str) -> torch.nn.Module:
    reference = copy.deepcopy(net)
    swap_norms(reference, target)
    return reference


@pytest.mark.parametrize("target", ["mrs", "dyt"])
def test_swap_after_fx_trace_of_norm_layers(target):
    net, x = small_net(hand_written=False), torch.randn(2, 5, 8)
    expected = _swapped_eager(net, target)(x)
    graph = torch.fx.symbolic_trace(net)
    swap_norms(graph, target)
    assert torch.equal(graph(x), expected)


def test_swap_after_fx_trace_of_a_hand_written_rmsnorm():
    """The traced graph holds pow/mean/rsqrt where the eager model held an RMSNorm: seen, or refused."""
    net, x = small_net(), torch.randn(2, 5, 8)
    expected = _swapped_eager(net, "mrs")(x)
    graph = torch.fx.symbolic_trace(net)
    equal_or_refused(lambda: swap_norms(graph, "mrs"), expected, lambda _: graph(x), ValueError)


def test_swap_after_export_of_a_transformers_model():
    model, ids = Logits(tiny_causal_lm("llama")).eval(), token_batch()
    with torch.no_grad():
        expected = _swapped_eager(model, "mrs")(ids)
    exported = torch.export.export(model, (ids,)).module()
    equal_or_refused(lambda: swap_norms(exported, "mrs"), expected, lambda _: exported(ids), ValueError)


@pytest.mark.parametrize("how", ["net", pytest.param("llama", marks=slow), pytest.param("llama_forward", marks=slow)])
def test_swap_after_compile(how):
    """``torch.compile(model)`` run once, then swapped: the next call runs the swapped model (dynamo recompiles)."""
    torch._dynamo.reset()
    if how == "net":
        model, x = small_net(), torch.randn(2, 5, 8)
    else:
        model, x = tiny_causal_lm("llama"), token_batch()
    run = (lambda m: m(x)) if how == "net" else (lambda m: m(x).logits)
    with torch.no_grad():
        expected = run(_swapped_eager(model, "mrs"))
    if how == "llama_forward":
        model.forward = torch.compile(model.forward, backend="aot_eager")
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        run(compiled)
        swap_norms(compiled, "mrs")
        assert torch.equal(run(compiled), expected)


def test_swap_after_peft_equals_peft_after_swap():
    peft = pytest.importorskip("peft")
    config = dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    base = tiny_causal_lm("llama")
    first = swap(copy.deepcopy(base), "llama-mrs")
    torch.manual_seed(1)
    expected = logits_of(peft.get_peft_model(first, peft.LoraConfig(**config)))
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(**config))
    swap(wrapped, "llama-mrs")
    assert torch.equal(logits_of(wrapped), expected)


def test_swap_on_meta_then_load(built):
    """accelerate's ``init_empty_weights``: the plain model built on meta, swapped there, then the saved weights."""
    accelerate = pytest.importorskip("accelerate")
    b = built("gemma-rms-half")
    with accelerate.init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(tiny_config("gemma"))
    swap(empty, "gemma-rms-half")
    empty.tie_weights()
    loaded = accelerate.load_checkpoint_and_dispatch(empty, str(b.path), device_map={"": "cpu"})
    assert torch.equal(logits_of(loaded), b.logits)


# ---- runs: a resume with an option the recipe lets change (faults, other options: docs/exits.md's table) -----

VISION = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
          "--data.image_size", "8", "--data.batch_size", "8", "--trainer.val_check_interval", "2",
          "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"]


def _last(root: Path) -> Path:
    return root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory) -> Path:
    """The tiny LM run's checkpoint after 2 steps (32-true, the default devices)."""
    from helpers.lm import TINY
    from recipes.lm import run

    root = tmp_path_factory.mktemp("lm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["lm.py"])
        assert run([*TINY, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root)]) == 0
    return _last(root)


@slow  # a 2-step LM fit (about 15 s on 2 busy cores)
@pytest.mark.parametrize(("option", "value", "change"), [
    ("--trainer.precision", "bf16-mixed", "--trainer.precision '32-true' -> 'bf16-mixed'"),
    ("--trainer.devices", "2", "--trainer.devices 'auto' -> '2'")], ids=["precision", "devices"])
def test_lm_resume_with_an_option_changed_names_it_once(lm_checkpoint, tmp_path, caplog, monkeypatch, option, value,
                                                        change):
    from helpers.lm import TINY
    from recipes.lm import build_cli

    monkeypatch.setattr(sys, "argv", ["lm.py"])
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    cli = build_cli([*TINY, "--trainer.max_steps", "2", option, value, "--trainer.default_root_dir", str(tmp_path),
                     "--ckpt_path", str(lm_checkpoint)])
    notes = [m for m in caplog.messages if m.startswith("note: resuming")]
    assert notes == [f"note: resuming {lm_checkpoint} with options that differ from the checkpoint's, from its step "
                     f"on: {change}"]
    applied = {"--trainer.precision": cli.trainer.precision, "--trainer.devices": str(cli.trainer.num_devices)}
    assert applied[option] == value


@slow  # two image fits of 2 and 3 steps
def test_image_resume_with_another_precision_names_it(tmp_path, monkeypatch, capfd, caplog):
    from recipes.cifar100 import run

    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    assert run([*VISION, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path / "a")]) == 0
    capfd.readouterr()
    caplog.set_level(logging.INFO)
    status = run([*VISION, "--trainer.max_steps", "3", "--trainer.precision", "bf16-mixed",
                  "--trainer.default_root_dir", str(tmp_path / "b"), "--ckpt_path", str(_last(tmp_path / "a"))])
    out = capfd.readouterr()
    text = out.out + out.err + caplog.text
    assert status == 0 and re.search(r"--trainer\.precision '?32-true'? -> '?bf16-mixed", text), text[-3000:]


# ---- the page ---------------------------------------------------------------------------------------------------


def test_every_test_named_in_docs_exits_exists():
    """docs/exits.md names a test for every row: each file and test function exists (the parameters: -m slow)."""
    nodes, files = named_tests(ROOT)
    assert len(nodes) >= 80, "docs/exits.md lists the rows with their tests"
    for path in files:
        assert (ROOT / path).is_file(), path
    defined: dict[str, set[str]] = {}
    for node in nodes:
        path, name = node.split("[")[0].split("::")
        if path not in defined:
            tree = ast.parse((ROOT / path).read_text())
            defined[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined[path], f"docs/exits.md names {node}: no {name} in {path}"


@slow  # a pytest subprocess collecting every file the page names (about 35 s on 2 busy cores)
def test_every_node_named_in_docs_exits_is_collected():
    nodes, _ = named_tests(ROOT)
    paths = sorted({n.split("::")[0] for n in nodes})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider",
                          *paths], cwd=ROOT, capture_output=True, text=True, timeout=600)
    collected = [line for line in out.stdout.split() if "::" in line]
    missing = sorted(n for n in nodes if not (fnmatch.filter(collected, n.replace("[", "[[]"))
                                             or (("[" not in n) and any(c.startswith(n + "[") for c in collected))))
    assert collected and not missing, f"docs/exits.md names tests that are not collected: {missing}\n{out.stderr[-2000:]}"
