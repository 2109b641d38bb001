"""Which weights produced what (docs/async_rl.md): a saved version of a run's weights, and the span of
a sampled sequence's tokens each version decoded. Plain dataclasses (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightsVersion:
    """A sampler checkpoint as a version: ``path`` (tinker://<run>/sampler_weights/<name>; "" for the
    base model) and ``version``, the run's in-flight counter (1, 2, ...; 0 for a snapshot or the base
    model). A sampling client made on ``path`` scores with exactly these weights."""

    path: str
    version: int


@dataclass(frozen=True)
class VersionSpan:
    """Tokens [first_token, first_token + count) of a sampled sequence were decoded with the weights at
    ``path`` (in-flight ``version``)."""

    path: str
    version: int
    first_token: int
    count: int

    @property
    def weights(self) -> WeightsVersion:
        return WeightsVersion(self.path, self.version)


def token_versions(spans: list[VersionSpan]) -> list[int]:
    """The version of each token, in order (spans cover every token)."""
    return [span.version for span in spans for _ in range(span.count)]


def weights_from_proto(message) -> WeightsVersion:
    return WeightsVersion(message.path, message.version)


def spans_from_proto(spans) -> list[VersionSpan]:
    return [VersionSpan(s.weights.path, s.weights.version, s.first_token, s.count) for s in spans]
