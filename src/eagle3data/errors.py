"""Every error a user can fix, under one base.

A job that fails with a :class:`UserError` logs its message as one line and exits
(see :mod:`eagle3data.jobs`); anything else is a bug and keeps its traceback. Each
error also keeps the built-in base callers would expect (``ValueError`` for bad data
or config, ``RuntimeError`` for a run that cannot go on)::

    UserError
    ├── ConfigError             (ValueError)    the workflow config asks for what cannot run
    ├── ModelConfigError        (ValueError)    the model's config.json is ambiguous or incomplete
    ├── PromptFormatError       (ValueError)    a malformed prompt record: file, line, field
    ├── ChatTemplateError       (ValueError)    a conversation the chat template cannot render
    ├── ResponseError           (ValueError)    a response row that makes no samples: file, line
    ├── AuxLayerError           (ValueError)    aux-layer ids that cannot be right for the model
    ├── ShardFormatError        (ValueError)    data that does not fit the shard format
    ├── DraftVocabError         (ValueError)    a draft vocabulary that cannot be built
    ├── JournalCorruptError     (RuntimeError)  a generation journal something else wrote to
    ├── JournalLockedError      (RuntimeError)  another live process appends to the journal
    ├── EngineUnavailable       (RuntimeError)  no generation endpoint answered
    ├── GenerationAborted       (RuntimeError)  error limits or a signal stopped generation
    ├── GpuSlotError            (RuntimeError)  a job cannot get the GPUs it needs
    │   └── GpuSlotTimeout                      they stayed taken for too long
    ├── SGLangCaptureError      (RuntimeError)  SGLang cannot capture what was asked for
    ├── CaptureEngineError      (RuntimeError)  the shared capture engine or its shard failed
    ├── PhaseError              (RuntimeError)  a capture while generation holds its GPUs
    ├── VLLMCaptureError        (RuntimeError)  the vLLM server does not capture as asked
    ├── DiskSpaceError          (RuntimeError)  the hidden states would not fit on the disk
    ├── SpeculatorsExportError  (RuntimeError)  shards not exportable exactly for speculators
    ├── DraftCheckError         (ValueError)    a draft check that cannot run as configured
    └── ValidationError         (RuntimeError)  produced data failed a check

This module imports nothing, so the job runner can tell a user error from a bug on its
way out of a stopped job without importing anything heavy.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's config, data or environment; the message says what to do."""


class ConfigError(UserError, ValueError):
    """The workflow config (or this environment) cannot run what it asks for; one line per
    problem, naming the keys."""


class ModelConfigError(UserError, ValueError):
    """The model's config.json does not say unambiguously what the text decoder is."""


class PromptFormatError(UserError, ValueError):
    """A malformed source record; the message names file, line and field."""


class ChatTemplateError(UserError, ValueError):
    """A conversation cannot be rendered, or its assistant spans cannot be derived."""


class ResponseError(UserError, ValueError):
    """A response row that cannot be made into training samples (names file and line)."""


class AuxLayerError(UserError, ValueError):
    """Aux-layer ids that cannot be right for this model."""


class ShardFormatError(UserError, ValueError):
    """Data that does not fit the shard format (bad shapes, wrong attrs, not a shard)."""


class DraftVocabError(UserError, ValueError):
    """The requested draft vocabulary cannot be built (config or data problem)."""


class JournalCorruptError(UserError, RuntimeError):
    """A complete line of the journal is not a JSON record."""


class JournalLockedError(UserError, RuntimeError):
    """Another live process is appending to the same journal."""


class EngineUnavailable(UserError, RuntimeError):
    """No endpoint answered the start-up health check."""


class GenerationAborted(UserError, RuntimeError):
    """The run stopped early (error limits or a signal); finished work is kept."""


class GpuSlotError(UserError, RuntimeError):
    """A job cannot get the GPUs it needs; the message says why."""


class GpuSlotTimeout(GpuSlotError):
    """All GPUs stayed taken for longer than the timeout."""


class SGLangCaptureError(UserError, RuntimeError):
    """SGLang is missing, refuses the capture settings, or returned hidden states that
    cannot be the ones asked for."""


class CaptureEngineError(UserError, RuntimeError):
    """The capture engine shard jobs share failed, or a shard it captured did: its message,
    one line (hidden_states/capture_service.py)."""


class PhaseError(UserError, RuntimeError):
    """A capture started while generation's server holds the GPUs it needs."""


class VLLMCaptureError(UserError, RuntimeError):
    """The vLLM capture server is unreachable, does not extract hidden states as the
    config asks, or returned states that cannot be the ones asked for."""


class DiskSpaceError(UserError, RuntimeError):
    """The hidden states would not fit on the disk."""


class SpeculatorsExportError(UserError, RuntimeError):
    """The shards cannot be made into exactly what speculators trains on."""


class DraftCheckError(UserError, ValueError):
    """The trained-draft check cannot run: its settings, its dependencies, the target's
    final norm or the memory the shards would need."""


class ValidationError(UserError, RuntimeError):
    """Produced data failed a check; the message lists every problem."""


#: What ends a job with one line instead of a traceback: our own errors, and a file the
#: config names that is not there.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError)


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS)
