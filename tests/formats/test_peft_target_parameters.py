"""PEFT ``target_parameters`` adapters: LoRA on stacked MoE expert tensors (``ParamWrapper``).

peft >= 0.22 writes them for any MoE model whose ``target_modules`` name its experts'
projections (it turns those names into ``target_parameters``); ``target_parameters`` can also
be set by hand. The file names the experts module, one ``.base_layer`` deeper per nested
wrapper; the config's ``rank_pattern``/``alpha_pattern`` are matched on
``<module>.<parameter>``. Every file here is written by PEFT itself on transformers' own MoE
classes (tiny configs), and every merge is compared with PEFT's ``merge_and_unload()``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.errors import AdapterFormatError, UnmatchedKeysError
from shuttle.formats.peft import PeftConfig
from tests import close

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _qwen2_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=40, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=3,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts_per_tok=1)
    return transformers.Qwen2MoeForCausalLM(config)


def _gpt_oss() -> torch.nn.Module:
    """Experts stored (experts, in, out) (``is_transposed``); hidden == intermediate makes
    ``down_proj`` square, so only the module tells its layout."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=3,
        num_experts_per_tok=1, max_position_embeddings=64)
    return transformers.GptOssForCausalLM(config)


MODELS = {"Qwen2Moe": _qwen2_moe, "GptOss": _gpt_oss}


def _peft_file(tmp_path, base: torch.nn.Module, **config) -> torch.nn.Module:
    """Save PEFT's adapter of ``config`` on ``base`` (factors random) to ``tmp_path``; return
    PEFT's own merge."""
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False,
                                                                  **config))
    pm.save_pretrained(tmp_path)
    return pm.merge_and_unload()


def _assert_merged_as_peft(got: dict[str, torch.Tensor], want: torch.nn.Module,
                           base: torch.nn.Module) -> None:
    before = dict(base.named_parameters())
    experts = [n for n, _ in want.named_parameters() if ".experts." in n and "bias" not in n]
    assert experts
    for name, p in want.named_parameters():
        close(got[name], p.detach(), rtol=1e-6, atol=1e-6)
    for name in experts:  # the experts really moved
        assert not torch.allclose(before[name], got[name])


@pytest.mark.parametrize("arch", list(MODELS))
def test_merge_equals_peft(tmp_path, arch):
    base = MODELS[arch]()
    want = _peft_file(tmp_path, base, r=2, lora_alpha=4, target_modules=["q_proj"],
                      target_parameters=EXPERTS, rank_pattern={"down_proj": 3},
                      alpha_pattern={"down_proj": 9})
    lora = shuttle.load_lora(tmp_path)
    assert {p.kind for ps in lora.modules.values() for p in ps} == {"lora", "experts_lora"}
    merged = copy.deepcopy(base)
    report = shuttle.merge_lora(merged, [(lora, 1.0)])
    assert not report.unmatched
    _assert_merged_as_peft(dict(merged.named_parameters()), want, base)


def test_experts_named_in_target_modules_merge_as_peft(tmp_path):
    """What peft >= 0.22 writes for ``target_modules=[..., "down_proj"]`` on a MoE model:
    nested wrappers on the fused experts (gate_up_proj at twice the rank), beside a LoRA on
    the shared expert's ``down_proj`` Linear."""
    base = _qwen2_moe()
    want = _peft_file(tmp_path, base, r=4, lora_alpha=8,
                      target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    if not config.get("target_parameters"):
        pytest.skip(f"peft {peft.__version__} adapts no experts from target_modules")
    merged = copy.deepcopy(base)
    report = shuttle.merge_lora(merged, [(tmp_path, 0.5)])
    assert not report.unmatched
    before = dict(base.named_parameters())
    for name, p in want.named_parameters():  # W + 0.5 (W_peft - W)
        close(dict(merged.named_parameters())[name], before[name] + 0.5 * (p - before[name]),
              rtol=1e-6, atol=1e-6)


def _moe(**stacked: tuple[int, ...]) -> torch.nn.Module:
    """A module of our own: ``experts`` holding the ``stacked`` tensors, and a Linear ``lin``."""
    torch.manual_seed(0)
    moe = torch.nn.Module()
    moe.experts = torch.nn.Module()
    for name, shape in stacked.items():  # registered in this order
        setattr(moe.experts, name, torch.nn.Parameter(torch.randn(shape)))
    moe.lin = torch.nn.Linear(8, 8)
    return moe


def _merges_as_peft(tmp_path, base: torch.nn.Module, **config) -> None:
    want = _peft_file(tmp_path, base, r=2, **config)
    merged = copy.deepcopy(base)
    assert not shuttle.merge_lora(merged, [(tmp_path, 1.0)], strict=True).unmatched
    got = dict(merged.named_parameters())
    for name, p in want.named_parameters():
        close(got[name], p.detach(), rtol=1e-6, atol=1e-6)


def test_a_module_without_is_transposed_is_read_as_experts_out_in(tmp_path):
    """PEFT's rule for a module of its own: (experts, out, in) unless ``is_transposed``."""
    _merges_as_peft(tmp_path, _moe(gate_up_proj=(3, 8, 12), down_proj=(3, 6, 8)),
                    target_modules=["lin"],
                    target_parameters=["experts.gate_up_proj", "experts.down_proj"])


def test_parameters_of_one_shape_are_placed_as_peft_nests_them(tmp_path):
    """Two stacked tensors of one shape and rank: the factors fit both, and PEFT's nesting
    (the module's registration order, first innermost; here not alphabetical) says which."""
    _merges_as_peft(tmp_path, _moe(w2=(3, 8, 8), w1=(3, 8, 8)),
                    target_parameters=["experts.w1", "experts.w2"])


def test_merge_files_and_load_checkpoint_equal_peft(tmp_path):
    """From a checkpoint's shapes alone the (experts, out, in) layout follows from non-square
    tensors; loading into the model reads its ``is_transposed``."""
    base = _qwen2_moe()
    want = _peft_file(tmp_path / "a", base, r=2, target_modules=["q_proj"],
                      target_parameters=EXPERTS)
    ckpt = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, ckpt)
    shuttle.merge_files(ckpt, [(tmp_path / "a", 1.0)], tmp_path / "out.safetensors", strict=True)
    from safetensors.torch import load_file
    _assert_merged_as_peft(load_file(tmp_path / "out.safetensors"), want, base)

    gpt = _gpt_oss()
    want = _peft_file(tmp_path / "b", gpt, r=2, target_modules=["q_proj"],
                      target_parameters=EXPERTS)
    save_file({k: v.contiguous() for k, v in gpt.state_dict().items()}, ckpt)
    with torch.device("meta"):
        empty = copy.deepcopy(gpt).to("meta")
    report = shuttle.load_checkpoint(empty, ckpt, [(tmp_path / "b", 1.0)], device="cpu")
    assert not report.unmatched
    _assert_merged_as_peft(dict(empty.named_parameters()), want, gpt)


def test_a_square_tensor_from_a_checkpoint_is_refused_with_the_fix(tmp_path):
    """GPT-OSS's square ``down_proj`` fits either layout: a checkpoint's shapes cannot say
    which, so strict merging names the parameter and what to do, and writes nothing."""
    gpt = _gpt_oss()
    _peft_file(tmp_path, gpt, r=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    ckpt = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in gpt.state_dict().items()}, ckpt)
    out = tmp_path / "out.safetensors"
    with pytest.raises(UnmatchedKeysError, match="is_transposed"):
        shuttle.merge_files(ckpt, [(tmp_path, 1.0)], out, strict=True)
    assert not out.exists()


def test_factors_for_another_model_are_reported_not_merged(tmp_path):
    _peft_file(tmp_path, _qwen2_moe(), r=2, target_modules=None, target_parameters=EXPERTS)
    other = MODELS["GptOss"]()
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(UnmatchedKeysError, match="fit none"):
        shuttle.merge_lora(other, [(tmp_path, 1.0)], strict=True)
    assert all(torch.equal(before[n], p) for n, p in other.named_parameters())


def test_dynamic_and_scoped_forwards_equal_peft(tmp_path):
    base = _qwen2_moe()
    want = _peft_file(tmp_path, base, r=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(base)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        with shuttle.apply_lora(model, [(tmp_path, 1.0)]):  # a merge, undone on exit
            _assert_merged_as_peft(dict(model.named_parameters()), want, base)
        for name, p in base.named_parameters():
            assert torch.equal(dict(model.named_parameters())[name], p), name
        shuttle.attach_lora(model, [(tmp_path, 1.0)])
        close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field, value", [("target_parameters", "down_proj"),
                                          ("target_parameters", [1]),
                                          ("target_modules", [None])])
def test_a_malformed_target_list_is_refused(field, value):
    with pytest.raises(AdapterFormatError, match=field):
        PeftConfig.from_dict({"r": 2, field: value})


def test_which_modules_hold_wrappers():
    """A module key is a wrapper's when the config adapts a parameter there and
    ``target_modules`` does not name the module (a list: the name or a dotted suffix; a
    string: a regular expression over the whole name)."""
    m = "base_model.model.model.layers.0.mlp."
    for targets in (["q_proj", "down_proj"], r".*\.(q_proj|down_proj)"):
        cfg = PeftConfig.from_dict({"target_modules": targets,
                                    "target_parameters": ["down_proj", "mlp.experts.gate_up"]})
        assert cfg.wrapped_parameter(m + "experts") == (m + "experts", 0, ("down_proj",
                                                                           "gate_up"))
        assert cfg.wrapped_parameter(m + "experts.base_layer.base_layer") == \
            (m + "experts", 2, ("down_proj", "gate_up"))
        assert cfg.wrapped_parameter(m + "shared_expert.down_proj") is None
        assert cfg.wrapped_parameter("base_model.model.other.experts") == \
            ("base_model.model.other.experts", 0, ("down_proj",))
    assert PeftConfig.from_dict({"target_modules": ["q"]}).wrapped_parameter(m + "x") is None
    linear = PeftConfig.from_dict({"target_modules": "all-linear",
                                   "target_parameters": ["down_proj"]})
    assert linear.wrapped_parameter(m + "q_proj") is None
    assert linear.wrapped_parameter(m + "experts.base_layer")[1:] == (1, ("down_proj",))
