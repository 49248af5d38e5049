"""``shuttle.integrations.transformers.from_pretrained``: a tiny Llama saved with
``save_pretrained`` and built back straight from its files, against the model saved (CPU copy
mode keeps every bit: logits and greedy tokens compared exactly).
"""

from __future__ import annotations

import pytest
import torch

from shuttle.cache import ModelCache
from shuttle.errors import (
    AdapterFileError,
    CacheError,
    CheckpointMismatchError,
    HostBackingError,
    HostMemoryError,
    InvalidOptionError,
    MissingParameterError,
    OffloadError,
)
from shuttle.integrations import budgets
from shuttle.integrations import transformers as shuttle_transformers
from tests.integrations.models import tiny_llama

pytest.importorskip("transformers")

IDS = torch.tensor([[3, 14, 15, 9, 26], [1, 2, 3, 4, 5]])


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def generate(model) -> torch.Tensor:
    return model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=6,
                          do_sample=False, pad_token_id=0)


def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)).eval()


def save(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.mark.parametrize("shard", [None, "20KB"])
@pytest.mark.parametrize("vram_budget", [None, 130_000])
def test_logits_and_generate_equal_the_saved_model(tmp_path, shard, vram_budget):
    ref = tiny_llama()
    folder = save(ref, tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    model, handle = shuttle_transformers.from_pretrained(folder, device="cpu", prefetch=1,
                                                         vram_budget=vram_budget)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # inv_freq is no weight of the file: computed when the model was built, as it was saved
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert torch.equal(logits(model), logits(ref))
    assert torch.equal(generate(model), generate(ref))
    assert list(handle.offloaders["model"].blocks) == ["model.layers"]
    handle.remove()
    assert all(p.is_meta for p in model.parameters())


def test_tied_weights_are_read_once_and_stay_tied(tmp_path):
    from safetensors import safe_open

    ref = tied_llama()
    save(ref, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert "lm_head.weight" not in keys  # saved once, under the embedding's name
    model, handle = shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    storage = handle.offloaders["model"].storage
    unique = {id(t): t for t in [*ref.parameters(), *ref.buffers()]}  # the tie once
    assert storage.weight_bytes == sum(t.nbytes for t in unique.values())
    assert torch.equal(logits(model), logits(ref))
    handle.remove()


def test_a_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    ref = tied_llama()
    save(ref.model, tmp_path)  # a LlamaModel: keys without the "model." prefix
    model, handle = shuttle_transformers.from_pretrained(tmp_path, device="cpu",
                                                         model_cls=type(ref))
    assert torch.equal(logits(model), logits(ref))
    handle.remove()


def test_an_auto_class_and_torch_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    ref = tiny_llama()
    save(ref, tmp_path)  # float32
    model, handle = shuttle_transformers.from_pretrained(
        tmp_path, AutoModelForCausalLM, torch_dtype=torch.bfloat16, device="cpu")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for t in [*plain.parameters(), *plain.buffers()]:
            t.data = t.data.clone()  # aligned memory, as shuttle's arenas
    assert {k: v.dtype for k, v in model.state_dict().items()} == {
        k: v.dtype for k, v in plain.state_dict().items()}
    assert model.dtype == torch.bfloat16
    assert torch.equal(logits(model), logits(plain))
    handle.remove()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_checkpoint_is_widened_exactly_while_read(tmp_path, fp8):
    from safetensors.torch import save_file

    ref = tiny_llama()
    save(ref, tmp_path)
    # the checkpoint as fp8 files hold it: the projections' weights in float8, the rest as is
    state = {k: v.to(fp8) if k.endswith("proj.weight") else v
             for k, v in ref.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("proj.weight"):
                p.copy_(p.to(fp8))  # each value rounded to float8 once, then exact in float32
    model, handle = shuttle_transformers.from_pretrained(tmp_path, torch_dtype=torch.float32,
                                                         device="cpu")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert torch.equal(logits(model), logits(ref))
    handle.remove()


def test_modules_transformers_keeps_in_float32_stay_float32(tmp_path):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=16, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                            num_heads=4)).save_pretrained(tmp_path)
    model, handle = shuttle_transformers.from_pretrained(tmp_path, torch_dtype=torch.float16,
                                                         device="cpu")
    plain = T5EncoderModel.from_pretrained(tmp_path, dtype=torch.float16)
    expected = {k: v.dtype for k, v in plain.state_dict().items()}
    assert expected["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == torch.float32
    assert {k: v.dtype for k, v in model.state_dict().items()} == expected
    handle.remove()


def _rewritten(folder, drop=(), add=None, reshape=None):
    """Rewrite ``folder``'s model.safetensors without ``drop``, with ``add``, ``reshape``d."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for k in drop:
        del tensors[k]
    tensors.update(add or {})
    for k, shape in (reshape or {}).items():
        tensors[k] = torch.zeros(shape)
    save_file(tensors, path, metadata={"format": "pt"})


def test_tensors_the_files_or_the_model_lack_are_typed_errors(tmp_path):
    save(tiny_llama(), tmp_path)
    _rewritten(tmp_path, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(MissingParameterError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    save(tiny_llama(), tmp_path)
    _rewritten(tmp_path, add={"model.layers.9.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointMismatchError, match=r"lacks.*model\.layers\.9\.extra\.weight"):
        shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    save(tiny_llama(), tmp_path)
    _rewritten(tmp_path, reshape={"model.norm.weight": (16,)})
    with pytest.raises(CheckpointMismatchError, match=r"model\.norm\.weight \(file \(16,\), "
                                                      r"model \(32,\)\)"):
        shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    save(tiny_llama(), tmp_path)  # keys transformers ignores: rotary buffers saved by old code
    _rewritten(tmp_path, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)})
    model, handle = shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    handle.remove()
    save(tiny_llama(), tmp_path)  # an integer tensor for a float weight: no conversion
    _rewritten(tmp_path, add={"model.norm.weight": torch.zeros(32, dtype=torch.int32)})
    with pytest.raises(HostBackingError, match=r"model\.norm\.weight"):
        shuttle_transformers.from_pretrained(tmp_path, device="cpu")


def test_a_folder_without_config_or_architecture_is_refused(tmp_path):
    import json

    save(tiny_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OffloadError, match="pass model_cls="):
        shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    (tmp_path / "config.json").unlink()
    with pytest.raises(AdapterFileError, match="no config.json"):
        shuttle_transformers.from_pretrained(tmp_path, device="cpu")


def test_budgets_and_torch_dtype_as_users_spell_them(tmp_path, monkeypatch):
    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    ref = tiny_llama()
    folder = save(ref, tmp_path / "m")
    budget = sum(t.nbytes for t in ref.state_dict().values()) // 3
    model, handle = shuttle_transformers.from_pretrained(
        folder, device="cpu", torch_dtype="fp32", vram_budget="130kB",
        max_host_bytes=f"{budget / 1000}kB")
    assert model.dtype == torch.float32 and handle._vram_budget == 130_000
    storage = handle.offloaders["model"].storage
    assert torch.equal(logits(model), logits(ref))
    assert storage.host_bytes <= budget
    assert storage.reader.bytes_read > 0  # the host ceiling holds a third: the rest from disk
    handle.remove()


def test_auto_holds_what_this_machine_has_available_and_reads_the_rest(tmp_path,
                                                                       monkeypatch):
    from shuttle.offload.host_memory import HOST_RESERVE

    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    ref = tiny_llama()
    folder = save(ref, tmp_path / "m")
    room = sum(t.nbytes for t in ref.state_dict().values()) // 3
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: HOST_RESERVE + room)
    model, handle = shuttle_transformers.from_pretrained(folder, device="cpu",
                                                         max_host_bytes="auto")
    storage = handle.offloaders["model"].storage
    assert handle.cache.max_bytes == room
    assert torch.equal(logits(model), logits(ref))
    assert storage.host_bytes <= room and storage.reader.bytes_read > 0
    handle.remove()


def test_no_ceiling_past_the_memory_available_is_refused_before_a_byte_is_read(tmp_path,
                                                                               monkeypatch):
    from shuttle.offload.host_memory import HOST_RESERVE

    ref = tiny_llama()
    folder = save(ref, tmp_path / "m")
    weights = sum(t.nbytes for t in ref.state_dict().values())
    reads = []
    monkeypatch.setattr(budgets.ModelOffloader, "from_module",
                        lambda *a, **k: reads.append(a) or pytest.fail("read"))
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: HOST_RESERVE + weights - 1)
    with pytest.raises(HostMemoryError, match="max_host_bytes='auto'"):
        shuttle_transformers.from_pretrained(folder, device="cpu")
    assert not reads
    # a ceiling, a cache or coded weights (their size is known once coded): no refusal here
    monkeypatch.undo()
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: HOST_RESERVE + weights - 1)
    for kwargs in ({"max_host_bytes": weights}, {"cache": ModelCache(weights)},
                   {"compress": "lossless"}):
        model, handle = shuttle_transformers.from_pretrained(folder, device="cpu", **kwargs)
        assert torch.equal(logits(model), logits(ref))
        handle.remove()
    # with room for it (and its buffers), as before: no ceiling
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: HOST_RESERVE + 2 * weights)
    model, handle = shuttle_transformers.from_pretrained(folder, device="cpu")
    assert handle.cache.max_bytes == budgets.NO_CEILING
    handle.remove()


@pytest.mark.parametrize("available", [None, 2**30])
def test_auto_where_nothing_can_be_given_is_refused(tmp_path, monkeypatch, available):
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: available)
    with pytest.raises(HostMemoryError, match="number of bytes"):
        shuttle_transformers.from_pretrained(tmp_path / "nowhere", device="cpu",
                                             max_host_bytes="auto")


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"torch_dtype": "int8"}, InvalidOptionError),
    ({"torch_dtype": torch.int8}, InvalidOptionError),
    ({"vram_budget": "6 GB of VRAM"}, OffloadError),
    ({"vram_budget": float("nan")}, OffloadError),
    ({"max_host_bytes": -1}, CacheError), ({"max_host_bytes": "16GiB", "cache": None}, None)])
def test_bad_arguments_are_refused_before_the_files_are_looked_at(tmp_path, kwargs, error):
    # a folder that is not there: a refusal of the arguments comes first
    with pytest.raises(error or AdapterFileError):
        shuttle_transformers.from_pretrained(tmp_path / "nowhere", device="cpu", **kwargs)


@pytest.mark.parametrize("vram_budget", [None, 130_000])
def test_a_host_budget_far_below_the_model_reads_the_rest_from_disk(tmp_path, monkeypatch,
                                                                    vram_budget):
    from shuttle.errors import FileChangedError

    # Staging buffers of one page, so that a model of a few hundred kB has a disk tier.
    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    ref = tiny_llama()
    folder = save(ref, tmp_path / "m")
    weights = sum(t.nbytes for t in ref.state_dict().values())
    budget = weights // 3
    model, handle = shuttle_transformers.from_pretrained(folder, device="cpu", prefetch=1,
                                                         vram_budget=vram_budget,
                                                         max_host_bytes=budget)
    storage = handle.offloaders["model"].storage
    for _ in range(2):
        assert torch.equal(logits(model), logits(ref))
        assert storage.host_bytes <= budget  # arenas and staging, by shuttle's own accounting
    assert torch.equal(generate(model), generate(ref))
    assert storage.reader.bytes_read > 0
    # the checkpoint rewritten under the streaming model: a typed error, never other weights
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-64:] = bytes(64)
    path.write_bytes(raw)
    handle.deactivate()
    with pytest.raises(FileChangedError):
        logits(model)
    handle.remove()


@pytest.mark.parametrize("ceiling", [None, 3])
def test_loading_shows_the_bytes_read_into_host_memory(tmp_path, monkeypatch, ceiling):
    from shuttle.cache import specs
    from tests import RecordedBar

    monkeypatch.setattr(specs, "tqdm", RecordedBar)
    monkeypatch.setattr(RecordedBar, "bars", [])
    monkeypatch.setattr(specs, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    ref = tiny_llama()
    weights = sum(t.nbytes for t in ref.state_dict().values())
    folder = save(ref, tmp_path / "m")
    model, handle = shuttle_transformers.from_pretrained(
        folder, device="cpu", max_host_bytes=None if ceiling is None else weights // ceiling)
    (bar,) = RecordedBar.bars
    storage = handle.offloaders["model"].storage
    held = sum(u.layout.weight_bytes for u in storage.units if u.arena is not None)
    # told unit by unit; it ends full at what was read (a ceiling leaves the rest on disk,
    # here everything: each unit's rotary buffer is held on the side, not in an arena)
    assert bar.desc.startswith("reading ") and bar.n == bar.total == held
    assert held == (storage.weight_bytes if ceiling is None else 0)
    handle.remove()


def coded_llama(monkeypatch, layers: int):
    """A small bf16 Llama (seeded) whose coded weights decode on the CPU by the reference."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shuttle.kernels import exponent_decode

    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)).to(torch.bfloat16).eval()


@pytest.mark.parametrize("shard", [None, "200KB"])
def test_a_compressed_checkpoint_streams_coded_from_its_file(tmp_path, shard, monkeypatch):
    """``shuttle compress`` on each weight file; the model is built from the coded files, its
    units kept coded as read (nothing coded at capture), outputs bit for bit those of the model
    built from the plain files (a bf16 build keeps its rotary tables as the library makes them,
    which a cast of the saved model does not).
    """
    from shuttle.weights import lossless
    from shuttle.weights.lossless_file import compress_file

    ref = coded_llama(monkeypatch, layers=2)
    folder = save(ref, tmp_path / "plain", **({"max_shard_size": shard} if shard else {}))
    coded = tmp_path / "coded"
    coded.mkdir()
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            compress_file(f, coded / f.name, progress=False)
        else:
            (coded / f.name).write_bytes(f.read_bytes())
    calls = []
    encode = lossless.LosslessTensor.encode_tensor
    monkeypatch.setattr(lossless.LosslessTensor, "encode_tensor",
                        classmethod(lambda cls, t, **kw: calls.append(1) or encode(t, **kw)))
    plain, plain_handle = shuttle_transformers.from_pretrained(
        folder, torch_dtype=torch.bfloat16, device="cpu", max_host_bytes=2**25)
    model, handle = shuttle_transformers.from_pretrained(coded, torch_dtype=torch.bfloat16,
                                                         device="cpu", max_host_bytes=2**25)
    off = handle.offloaders["model"]
    assert all(u.code is not None for u in off.storage.groups["model.layers"])
    assert not calls  # read coded, never coded again
    assert off.storage.host_bytes < 0.8 * plain_handle.offloaders["model"].storage.host_bytes
    assert torch.equal(logits(model), logits(plain))
    assert torch.equal(generate(model), generate(plain))
    handle.remove()
    plain_handle.remove()


def test_plain_files_under_a_host_ceiling_stream_with_compress(tmp_path, monkeypatch):
    """``compress="lossless"`` with ``max_host_bytes`` on plain files: under a ceiling below the
    plain model's host bytes, the layers kept in host memory are coded, the rest read plain
    from the files; logits and tokens bit for bit the plain model's."""
    ref = coded_llama(monkeypatch, layers=3)
    folder = save(ref, tmp_path / "plain")
    plain, plain_handle = shuttle_transformers.from_pretrained(
        folder, torch_dtype=torch.bfloat16, device="cpu", max_host_bytes=2**30)
    everything = plain_handle.offloaders["model"].storage.host_bytes
    ceiling = int(0.85 * everything)
    model, handle = shuttle_transformers.from_pretrained(
        folder, torch_dtype=torch.bfloat16, device="cpu", max_host_bytes=ceiling,
        compress="lossless")
    assert torch.equal(logits(model), logits(plain))
    assert torch.equal(generate(model), generate(plain))
    storage = handle.offloaders["model"].storage
    assert storage.host_bytes <= ceiling
    assert any(u.code is not None and not u.on_disk for u in storage.groups["model.layers"])
    handle.remove()
    plain_handle.remove()
