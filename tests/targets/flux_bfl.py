"""A parameter-only skeleton of FLUX.1-dev with Black Forest Labs' module names.

It has the module tree and parameter shapes of BFL's ``flux.model.Flux`` (as in the original
checkpoint ``flux1-dev.safetensors``) and no forward. Build it under ``torch.device("meta")``: it
then costs no memory. Layers without parameters (LayerNorms without affine, activations) are
left out, as they cannot be adapter targets.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 3072
HEAD_DIM = 128
MLP = 4 * HIDDEN  # 12288
DOUBLE_BLOCKS = 19
SINGLE_BLOCKS = 38
assert HIDDEN % HEAD_DIM == 0, "the attention heads must tile the hidden size"


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)


class SelfAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = QKNorm(HEAD_DIM)
        self.proj = nn.Linear(dim, dim)


class Modulation(nn.Module):
    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.lin = nn.Linear(dim, (6 if double else 3) * dim)


class DoubleStreamBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        for side in ("img", "txt"):
            setattr(self, f"{side}_mod", Modulation(dim, double=True))
            setattr(self, f"{side}_attn", SelfAttention(dim))
            setattr(self, f"{side}_mlp", nn.Sequential(nn.Linear(dim, MLP), nn.GELU(),
                                                       nn.Linear(MLP, dim)))


class SingleStreamBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear1 = nn.Linear(dim, 3 * dim + MLP)  # 21504: q, k, v and the MLP input
        self.linear2 = nn.Linear(dim + MLP, dim)  # 15360 -> 3072
        self.norm = QKNorm(HEAD_DIM)
        self.modulation = Modulation(dim, double=False)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, dim)
        self.out_layer = nn.Linear(dim, dim)


class LastLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(dim, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))


class FluxBFL(nn.Module):
    """FLUX.1-dev in BFL naming.

    Args:
        in_channels: ``img_in`` inputs: 64, or 128 for the Depth/Canny control models.
    """

    def __init__(self, in_channels: int = 64):
        super().__init__()
        self.img_in = nn.Linear(in_channels, HIDDEN)
        self.time_in = MLPEmbedder(256, HIDDEN)
        self.vector_in = MLPEmbedder(768, HIDDEN)
        self.guidance_in = MLPEmbedder(256, HIDDEN)
        self.txt_in = nn.Linear(4096, HIDDEN)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(HIDDEN) for _ in range(DOUBLE_BLOCKS))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(HIDDEN) for _ in range(SINGLE_BLOCKS))
        self.final_layer = LastLayer(HIDDEN, 64)
