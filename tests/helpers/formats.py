"""Response formats the structured-output tests share: pydantic models with bounded fields (a reply always
ends within a few dozen tokens) and OpenAI's json_schema format of one."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (as OpenAI's strict schemas: no other keys)
    reasoning: str = Field(max_length=80)
    answer: int = Field(ge=0, le=100000)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: str = Field(pattern="^(apples|pears|plums|bread)$")
    count: int = Field(ge=1, le=99)
    urgent: bool


def schema_format(model: type[BaseModel], strict: bool = True) -> dict:
    """OpenAI's ``response_format`` for `model`'s JSON schema."""
    return {
        "type": "json_schema",
        "json_schema": {"name": model.__name__, "schema": model.model_json_schema(), "strict": strict},
    }
