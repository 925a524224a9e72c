"""The training settings of every stage, as one typed schema that Hydra checks (a misspelt key or a value of
the wrong type stops the run before anything loads).

`TrainConfig` holds what the shared loop (`weaver.train.common.fit`) reads; the drafter and the adapter add
their own losses. The stages' YAML (`conf/model/tiny_hybrid.yaml`, `conf/drafter/dflash.yaml`,
`conf/weaver/default.yaml`) give only what differs from the defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TrainConfig:
    steps: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    warmup_steps: int = MISSING
    checkpoint_every: int = MISSING
    min_lr_ratio: float = 0.1  # warmup-stable-decay: the learning rate decays to this fraction of `lr`
    decay_fraction: float = 0.3  # ... over the last 30% of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    init_std: float = 0.02  # fresh weights: Normal(0, init_std), residual outputs scaled by depth
    precision: str = "auto"  # bf16 | fp32 | auto (bf16 where the hardware makes it fast, weaver/precision.py)
    eval_every: int | None = None  # steps between evaluation passes; null: only at the end
    log_every: int = 10


@dataclass
class DrafterTrainConfig(TrainConfig):
    anchors_per_seq: int = 8
    gamma: float = 7.0  # block position d weighted exp(-(d-1)/gamma)
    kl_weight: float = 0.0  # > 0 mixes in KL to the target's distribution
    heldout_rollouts: int = 0  # > 0: the last n rollouts are held out; top-1 per depth on them is logged (heldout_*)
    init: str = "random"  # random | target (layers copied from the target's last attention layers) | a drafter checkpoint


@dataclass
class AdapterLoss:
    """Weights of KL and total variation to the target's distribution restricted to the pool, and of
    cross-entropy on the realised token."""

    kl: float = 0.0
    tv: float = 0.0
    ce: float = 1.0


@dataclass
class AdapterTrainConfig(TrainConfig):
    anchors_per_seq: int = 16
    loss: AdapterLoss = field(default_factory=AdapterLoss)
    heldout_rollouts: int = 0  # > 0: the last n rollouts are held out and evaluated every eval_every steps
    read_text: bool = False  # also train on the text the target read for the drafter (drafter.text), greedy labels
    # after training, scale the adapter's correction to the drafter's logits by the factor (0-2, steps of 0.1) that
    # minimises the training loss on the held-out rollouts, folded into its weights (needs heldout_rollouts > 0)
    calibrate: bool = False


SCHEMAS = {"target": TrainConfig, "drafter": DrafterTrainConfig, "adapter": AdapterTrainConfig}


def register_schemas() -> None:
    """Make the schemas known to Hydra as `/schema/train/<stage>` (the stages' YAML list them in their defaults)."""
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(group="schema/train", name=name, node=schema)

