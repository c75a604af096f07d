"""A tool argument that is a nested pydantic model: pydantic writes its JSON schema with $defs and
$refs (openai.pydantic_function_tool and the Agents SDK send it so). Shared by the tool-call tests
of the chat and Responses APIs, the Agents SDK and the structural tags."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Address(BaseModel):
    city: Literal["Paris", "Rome"]
    floor: Literal[1, 2]


class Resident(BaseModel):
    name: Literal["ada", "bob"]
    home: Address
