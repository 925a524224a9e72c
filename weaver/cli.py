"""What the entry points share: set-up, and one clear line instead of a traceback for bad input."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from weaver.kernels.dispatch import KernelError
from weaver.errors import WeaverError

T = TypeVar("T")


def run_cli(job: Callable[[DictConfig], T], cfg: DictConfig) -> T:
    """Run a Hydra job; WeaverError, the kernels' KernelError (e.g. a bad WEAVER_KERNELS) and config errors
    print `error: ...` and exit with status 2."""
    if not _cuda():  # fla's Triton kernels need a GPU; keep transformers on its torch path
        sys.modules.setdefault("fla", None)
    try:
        return job(cfg)
    except (WeaverError, KernelError, OmegaConfBaseException, FileNotFoundError) as err:
        print(f"error: {_weaver_cause(err)}", file=sys.stderr)
        sys.exit(2)


def _weaver_cause(err: BaseException) -> BaseException:
    """Our own error behind a config error (one a resolver such as `artifact_of` raised), whose message is
    already the one line to show; else the error itself."""
    if not isinstance(err, OmegaConfBaseException):
        return err
    cause = err.__context__
    while cause is not None and not isinstance(cause, WeaverError):
        cause = cause.__context__
    return cause or err


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
