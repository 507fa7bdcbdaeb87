"""Which implementation runs attention, scoring and compaction on the device."""

from __future__ import annotations

import enum


class Backend(enum.Enum):
    XLA = "xla"  # plain XLA: CPU, and the reference everywhere
    PALLAS = "pallas"  # Pallas (Triton) kernels: GPU
    PALLAS_INTERPRET = "pallas-interpret"  # the Pallas kernels in the interpreter: their tests on CPU

    @property
    def uses_pallas(self) -> bool:
        return self is not Backend.XLA

    @property
    def interpret(self) -> bool:
        return self is Backend.PALLAS_INTERPRET

    @classmethod
    def parse(cls, value: "Backend | str") -> "Backend":
        """A Backend from itself or its value; ValueError naming the choices otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"backend must be one of {', '.join(b.value for b in cls)}, got {value!r}") from None

    @classmethod
    def resolve(cls, option: str, platform: str) -> "Backend":
        """The engine option `attention_backend` ("auto", "xla", "pallas") on `platform` ("gpu", "cpu", ...)."""
        if option == "auto":
            return cls.PALLAS if platform == "gpu" else cls.XLA
        return cls.parse(option)
