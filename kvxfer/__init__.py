"""kvxfer: a KV-cache transfer sidecar for prefill/decode disaggregated LLM serving.

The public, import-light surface: layouts, model profiles, the exact block
planner and the recompute rule. The sidecar (`kvxfer.server`), the engine
client (`kvxfer.client`) and the NIXL data plane (`kvxfer.dataplane`) are
imported on their own so that planning never pays for torch or nixl.
"""

from kvxfer._exceptions import (
    BusyError,
    DataPlaneError,
    InvalidInputError,
    KvxferError,
    LayoutError,
    LeaseError,
    LimitExceededError,
    NegotiationError,
    NotFoundError,
    PeerDisconnectedError,
    PlanError,
    ProfileError,
    RegistrationError,
    TransferError,
    UnsupportedModelError,
)
from kvxfer.core.layout import (
    BlockId,
    BlockSpan,
    EngineLayout,
    GroupId,
    GroupKind,
    KVGroup,
    Region,
    TensorSpec,
)
from kvxfer.core.planner import (
    Chunk,
    Descriptor,
    TransferPlan,
    full_attention_bytes,
    needed_blocks,
    plan_blocks,
    plan_transfer,
)
from kvxfer.core.profiles import builtin_profiles, layout_for_model, layout_from_config
from kvxfer.core.recompute import valid_tokens

__version__ = "0.1.0"

__all__ = [
    "BlockId",
    "BlockSpan",
    "BusyError",
    "Chunk",
    "DataPlaneError",
    "Descriptor",
    "EngineLayout",
    "GroupId",
    "GroupKind",
    "InvalidInputError",
    "KVGroup",
    "KvxferError",
    "LayoutError",
    "LeaseError",
    "LimitExceededError",
    "NegotiationError",
    "NotFoundError",
    "PeerDisconnectedError",
    "PlanError",
    "ProfileError",
    "Region",
    "RegistrationError",
    "TensorSpec",
    "TransferError",
    "TransferPlan",
    "UnsupportedModelError",
    "builtin_profiles",
    "full_attention_bytes",
    "layout_for_model",
    "layout_from_config",
    "needed_blocks",
    "plan_blocks",
    "plan_transfer",
    "valid_tokens",
]
