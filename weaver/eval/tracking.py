"""W&B logging of an eval run: its config, the result rows as a wandb.Table, and the figures.

Uses the same `wandb` settings as training (`weaver.tracking`). `eval.wandb=false` (or
`wandb.enabled=false`, or WANDB_MODE=disabled) turns it off.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from weaver.tracking import tracking_enabled, wandb_dir


def wandb_enabled(cfg: DictConfig) -> bool:
    return bool(cfg.eval.wandb) and tracking_enabled(cfg)


def _table_value(value):
    return json.dumps(value) if isinstance(value, list) else value  # Table cells hold scalars


def log_eval_run(cfg: DictConfig, rows: list[dict], figures: list[Path]) -> Path:
    """Log one eval run; returns the run's folder (what `wandb sync` takes when offline)."""
    import wandb

    run = wandb.init(project=cfg.wandb.project, mode=cfg.wandb.mode, dir=str(wandb_dir(cfg)), job_type="eval",
                     name=f"eval-{cfg.experiment}", config=OmegaConf.to_container(cfg, resolve=True))
    try:
        columns = list(dict.fromkeys(key for r in rows for key in r))
        table = wandb.Table(columns=columns, data=[[_table_value(r.get(c)) for c in columns] for r in rows])
        run.log({"results": table, **{f"figures/{p.stem}": wandb.Image(str(p)) for p in figures}})
        for r in rows:  # headline numbers as summary metrics, so runs can be compared in the W&B UI
            prefix = f"{r['dataset']}/{r['method']}" + (f"@{r['budget']}" if r["budget"] is not None else "")
            run.summary.update({f"{prefix}/{k}": r[k] for k in ("tau", "tokens_per_s", "speedup_vs_ar") if r.get(k) is not None})
        return Path(run.dir).parent
    finally:
        run.finish()
