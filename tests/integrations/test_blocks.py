"""Which block lists stream: uniform lists holding a large share of the model."""

from __future__ import annotations

from torch import nn

from shuttle.integrations.blocks import find_block_lists
from tests.integrations.models import tiny_llama


def _unet_like() -> nn.Module:
    """Unlike down blocks (different widths), each with a uniform list inside."""
    def stage(width: int) -> nn.Module:
        s = nn.Module()
        s.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        s.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))  # too small to stream
        return s

    model = nn.Module()
    model.stem = nn.Linear(8, 8)
    model.down = nn.ModuleList([stage(16), stage(32)])
    model.acts = nn.Sequential(nn.GELU(), nn.GELU())  # uniform but holds no tensors
    return model


def test_uniform_lists_inside_unlike_ones_are_found():
    assert find_block_lists(_unet_like()) == ["down.0.layers", "down.1.layers"]


def test_a_share_threshold_drops_small_lists():
    assert find_block_lists(_unet_like(), min_share=0.5) == ["down.1.layers"]


def test_decoder_layers_of_a_causal_lm():
    assert find_block_lists(tiny_llama()) == ["model.layers"]


def test_flux_double_and_single_blocks():
    from tests.integrations.models import tiny_flux

    assert find_block_lists(tiny_flux().transformer) == ["transformer_blocks",
                                                         "single_transformer_blocks"]


def test_a_t5_encoder_block_list_whose_first_block_differs():
    from tests.integrations.models import tiny_flux

    t5 = tiny_flux().text_encoder_2
    blocks = t5.encoder.block
    assert len({tuple(n for n, _ in b.named_parameters()) for b in blocks}) == 2  # not uniform
    assert find_block_lists(t5) == ["encoder.block"]


def test_lists_of_unlike_classes_or_sizes_are_searched_inside():
    class Wide(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    class Other(Wide):
        pass

    model = nn.Module()
    model.classes = nn.ModuleList([Wide(16), Other(16)])  # two classes: not one list
    model.sizes = nn.ModuleList([Wide(8), Wide(24)])  # one class, 9x the bytes
    model.close = nn.ModuleList([Wide(16), Wide(18)])  # one class, within 2x: one list
    assert find_block_lists(model, min_share=0.01) == [
        "classes.0.layers", "classes.1.layers", "sizes.0.layers", "sizes.1.layers", "close"]
