"""A stand-in for the wandb package, which is too large for the test extra (0.31.0: a 20 MB wheel, 100 MB
installed with its 25 dependencies): the names and parameters train/wandb_log.py calls, each call recorded in
`calls`. tests/test_wandb.py holds it to the real package's names where that is installed."""

calls: list = []


class Settings:
    def __init__(self, console: str | None = None):
        self.console = console


class Run:
    def log(self, data: dict, step: int | None = None, commit: bool | None = None) -> None:
        calls.append(("log", dict(data), step))

    def finish(self, exit_code: int | None = None) -> None:
        calls.append(("finish",))


def init(entity=None, project=None, dir=None, config=None, settings=None, **kw) -> Run:
    calls.append(("init", {"project": project, "dir": dir, "config": dict(config or {}),
                           "console": getattr(settings, "console", None), **kw}))
    return Run()
