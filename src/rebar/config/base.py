"""What every settings section shares: frozen, unknown keys refused, booleans never read as numbers,
and "" / "none" as the way to unset an optional setting."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator


def blank_to_none(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    return value


# Marks an optional setting: "" or "none" (any case) mean unset.
Unsettable = BeforeValidator(blank_to_none)


class Section(BaseModel):
    """One `[section]` of the settings. A field's `description` is its help text (the command line
    shows it beside the flag derived from it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # Lax mode would read `port = true` as 1.
        if (
            isinstance(value, bool)
            and info.field_name
            and cls.model_fields[info.field_name].annotation is not bool
        ):
            raise ValueError("expected a value of the setting's type, not true/false")
        return value
