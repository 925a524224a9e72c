"""Train pipeline entry point: `python train.py +experiment=tiny` (see conf/train.yaml)."""

import hydra
from omegaconf import DictConfig

from weaver.cli import run_cli
from weaver.pipeline import run_stages


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_cli(run_stages, cfg)


if __name__ == "__main__":
    main()
