"""Host storage, whole-model and block-streamed device residency, activation lifecycle."""

from shuttle.offload.adapters import ActivationAdapters
from shuttle.offload.host_storage import HostNeeds, HostStorage, Layout
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.layer_streamer import LayerStreamer
from shuttle.offload.offloader import CPU_COPY_ENV, ModelOffloader
from shuttle.offload.residency import (
    ResidencyPlan,
    ResidencyPolicy,
    RingOnlyResidency,
    SpreadResidency,
    StreamConfig,
    check_plan,
    floor_bytes,
    plan_cost,
    plan_host,
    plan_residency,
)
from shuttle.offload.slots import SlotPool
from shuttle.offload.streamer import BlockStreamer

__all__ = [
    "CPU_COPY_ENV",
    "ActivationAdapters",
    "BlockStreamer",
    "HostNeeds",
    "HostStorage",
    "HostUnit",
    "LayerStreamer",
    "Layout",
    "ModelOffloader",
    "ResidencyPlan",
    "ResidencyPolicy",
    "RingOnlyResidency",
    "SlotPool",
    "SpreadResidency",
    "StreamConfig",
    "check_plan",
    "floor_bytes",
    "plan_cost",
    "plan_host",
    "plan_residency",
]
