"""What a weight update from the control topic may make a worker load.

Anyone who can produce to the control topic can name a checkpoint; these checks run before
anything changes (no job is interrupted, no gate closed), and a refusal is acknowledged `failed`
with the reason:

- the checkpoint directory, symlinks resolved, lies under one of `--weights-root` (unset:
  nowhere, unless `--allow-any-weights-path`), and so does every entry in it (a symlinked
  `model.safetensors` pointing at another tree is another tree);
- it brings no code of its own (`auto_map` in its configs, `*.py` files) unless
  `--allow-remote-code-updates`: with `--trust-remote-code` among the engine arguments,
  transformers would import and run that code on every worker;
- `nccl` / `ipc` transfers, which make the worker join a rendezvous the command names, only
  with `--allow-weight-transfer`.

The start-up checkpoint (the engine's `--model`) is the operator's choice and not checked.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Final

from schemas import UpdateWeights
from worker.core.config import Settings
from worker.core.errors import WeightUpdateError

__all__ = ["WeightsPolicy"]

#: transformers reads `auto_map` (a class implemented in the checkpoint's own .py files) from
#: these (`AutoConfig`, `AutoTokenizer`, `AutoProcessor`, `AutoImageProcessor`, ...).
CODE_CONFIGS: Final = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "image_processor_config.json",
    "feature_extractor_config.json",
    "video_preprocessor_config.json",
)
#: A config larger than this is not read (a real one is a few KiB): refused.
MAX_CONFIG_BYTES: Final = 4 * 1024 * 1024
#: Entries of a checkpoint directory tree looked at before giving up (refused): real ones hold
#: tens of files.
MAX_ENTRIES: Final = 10_000


class WeightsPolicy:
    """The checks above, from the worker's settings."""

    def __init__(self, settings: Settings) -> None:
        self._roots = tuple(Path(r) for r in settings.weights_root)
        self._any_path = settings.allow_any_weights_path
        self._remote_code = settings.allow_remote_code_updates
        self._transfer = settings.allow_weight_transfer

    def check(self, update: UpdateWeights) -> None:
        """Raise `WeightUpdateError` saying why `update` may not be applied (blocking: it
        reads the checkpoint's directory; run it in a thread)."""
        if update.backend != "checkpoint":
            if not self._transfer:
                raise WeightUpdateError(
                    f"{update.backend} weight transfers are refused: the worker was started "
                    "without --allow-weight-transfer"
                )
            return
        assert update.path is not None  # noqa: S101 - the schema requires it
        self.check_checkpoint(update.path)

    def check_checkpoint(self, path: str) -> None:
        if "\x00" in path:
            raise WeightUpdateError("checkpoint path holds a NUL character")
        if not self._roots and not self._any_path:
            raise WeightUpdateError(
                "checkpoint updates from the control topic are refused: the worker was started "
                "without --weights-root (or --allow-any-weights-path)"
            )
        try:
            directory = Path(path).resolve(strict=True)
        except FileNotFoundError:
            raise WeightUpdateError(
                f"no checkpoint at {path}: {Path(path) / 'config.json'} is missing"
            ) from None
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            raise WeightUpdateError(f"checkpoint {path} cannot be resolved: {exc}") from None
        roots = self._resolved_roots()
        if roots and not any(directory.is_relative_to(root) for root in roots):
            raise WeightUpdateError(
                f"checkpoint {path} (resolved: {directory}) is outside --weights-root "
                f"{', '.join(str(r) for r in roots)}"
            )
        if not directory.is_dir():
            raise WeightUpdateError(f"checkpoint {path} is not a directory")
        self._check_entries(path, directory, roots)

    def _resolved_roots(self) -> list[Path]:
        roots = []
        for root in self._roots:
            try:
                roots.append(root.resolve(strict=True))
            except (OSError, RuntimeError):
                continue  # a root that does not exist (yet) holds nothing
        if self._roots and not roots:
            raise WeightUpdateError(
                f"no --weights-root exists: {', '.join(str(r) for r in self._roots)}"
            )
        return roots

    def _check_entries(self, path: str, directory: Path, roots: list[Path]) -> None:
        seen = 0
        for here, dirs, files in os.walk(directory):
            for name in [*dirs, *files]:
                seen += 1
                if seen > MAX_ENTRIES:
                    raise WeightUpdateError(
                        f"checkpoint {path} holds more than {MAX_ENTRIES} files: not a checkpoint"
                    )
                entry = Path(here) / name
                if roots and entry.is_symlink():
                    target = entry.resolve()
                    if not any(target.is_relative_to(root) for root in roots):
                        raise WeightUpdateError(
                            f"checkpoint {path}: {entry.relative_to(directory)} links outside "
                            f"--weights-root (to {target})"
                        )
                if name in files:
                    _check_regular(entry, directory, path)
                if not self._remote_code and name.endswith(".py"):
                    raise WeightUpdateError(
                        f"checkpoint {path} brings code ({entry.relative_to(directory)}): "
                        "refused without --allow-remote-code-updates"
                    )
        if not self._remote_code:
            for name in CODE_CONFIGS:
                if _has_auto_map(directory / name, path):
                    raise WeightUpdateError(
                        f"checkpoint {path}: {name} names its own code (auto_map): refused "
                        "without --allow-remote-code-updates"
                    )


def _check_regular(entry: Path, directory: Path, path: str) -> None:
    """A FIFO or a device among the files would block the loader's read or never end it."""
    try:
        mode = entry.stat().st_mode
    except OSError as exc:
        raise WeightUpdateError(
            f"checkpoint {path}: {entry.relative_to(directory)} cannot be read: {exc}"
        ) from None
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise WeightUpdateError(
            f"checkpoint {path}: {entry.relative_to(directory)} is not a regular file"
        )


def _has_auto_map(config: Path, path: str) -> bool:
    try:
        info = config.stat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise WeightUpdateError(f"checkpoint {path}: {config.name} cannot be read: {exc}") from None
    if not stat.S_ISREG(info.st_mode):  # checked with the other files; a race refuses too
        raise WeightUpdateError(f"checkpoint {path}: {config.name} is not a regular file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise WeightUpdateError(
            f"checkpoint {path}: {config.name} is {info.st_size} bytes, more than a config is"
        )
    try:
        fields = json.loads(config.read_bytes()[:MAX_CONFIG_BYTES])
    except (OSError, ValueError, RecursionError):
        return False  # not JSON: the engine's own loading says why, and runs nothing
    return isinstance(fields, dict) and "auto_map" in fields
