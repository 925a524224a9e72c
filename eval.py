"""Evaluation entry point: `python eval.py +experiment=tiny` (see conf/eval.yaml)."""

import hydra
from omegaconf import DictConfig

from weaver.cli import run_cli
from weaver.eval.run import evaluate


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_cli(evaluate, cfg)


if __name__ == "__main__":
    main()
