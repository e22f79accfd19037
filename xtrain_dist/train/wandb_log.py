"""--wandb PROJECT: the records of the metrics file as a Weights & Biases run, written by rank 0 through the
wandb package, the [wandb] extra.

The scalars are exactly --tensorboard's (tensorboard.scalars: train/loss, speed/ms, eval/val_loss, ...), logged
at the record's step, with the run's options as the W&B run's config. wandb itself decides where the run goes:
WANDB_MODE=offline keeps it on disk (`wandb sync` uploads it later) and needs no network or account; online, it
needs `wandb login` or WANDB_API_KEY. Its files go under WANDB_DIR (default: the working directory), in a
`wandb/` folder, which the run lists among its outputs (preflight.check_outputs). A resumed run is a new W&B run
that starts at the step after the checkpoint's, as a resumed --tensorboard writes a new event file.
"""

import os
from pathlib import Path

from ..command import must_be
from ..errors import XtrainError, install_hint
from .tensorboard import scalars

# wandb's own rule for a project name (wandb_settings.validate_project), checked before training instead of
# when rank 0 starts the run
PROJECT_FORBIDDEN = "/\\#?%:"
PROJECT_MAX = 128


def wandb_module():
    """The wandb package, or one line saying what to install."""
    try:
        import wandb
    except ImportError:
        raise XtrainError(f"--wandb needs the wandb package ({install_hint('wandb')})") from None
    return wandb


def folder() -> Path:
    """Where wandb writes this run's files: WANDB_DIR's (or the working directory's) wandb/ folder."""
    return Path(os.environ.get("WANDB_DIR") or ".") / "wandb"


def check(project: str) -> None:
    """Fail before training where the package is missing or the project name is one wandb refuses."""
    wandb_module()
    if not project or len(project) > PROJECT_MAX or any(c in project for c in PROJECT_FORBIDDEN):
        raise XtrainError(must_be("--wandb", f"a W&B project name of at most {PROJECT_MAX} characters, none of "
                                             f"{' '.join(PROJECT_FORBIDDEN)}", project))


class WandbLog:
    """Rank 0's W&B run: one log call per record, of the record's scalars at its step."""

    def __init__(self, project: str, config: dict):
        wandb = wandb_module()
        try:
            # console off: wandb would otherwise wrap the process's stdout and stderr, which the rank threads share
            self.run = wandb.init(project=project, dir=str(folder().parent), config=config,
                                  settings=wandb.Settings(console="off"))
        except Exception as err:  # no login while online, an unreachable server: wandb's own words, on one line
            why = " ".join(str(err).split()) or type(err).__name__
            raise XtrainError(f"--wandb {project}: wandb could not start the run: {why}") from None

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()
