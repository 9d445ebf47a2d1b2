"""What an agent call cost: tokens times the model's price.

Prices come from a user price file first (private or local models, negotiated rates), then
from `genai-prices` (pydantic's maintained table, MIT, shipped as a data snapshot inside the
package: no network). A model neither knows is not guessed at: its cost is `None`, with the
reason. The price file is YAML or JSON, model name to dollars per million tokens:

    my-local-model: {input_per_mtok: 0.0, output_per_mtok: 0.0}
    ft:gpt-4o-mini:acme: {input_per_mtok: 0.3, output_per_mtok: 1.2}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from tasks.models import InputError

PRICES_ENV = "EVALPIPE_PRICES"
_PRICE_KEYS = ("input_per_mtok", "output_per_mtok")


@dataclass(frozen=True)
class Price:
    input_per_mtok: float
    output_per_mtok: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


@dataclass(frozen=True)
class PriceTable:
    """The user's prices (`user`, from `source`) over genai-prices' table."""

    user: dict[str, Price] = field(default_factory=dict)
    source: str | None = None

    @classmethod
    def load(cls, path: str | Path | None = None) -> PriceTable:
        """The price file `path` (a run's: its `--prices`, else the file `EVALPIPE_PRICES`
        names, read where its configuration is built), else none. A file that cannot be read
        or has a bad entry is bad input naming the file and the model."""
        if not path:
            return cls()
        where = f"price file {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
            raise InputError(f"{where}: cannot read: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise InputError(f"{where}: expected a mapping of model name to {{input_per_mtok, output_per_mtok}}")
        return cls({str(model): _price(where, model, entry) for model, entry in data.items()}, str(path))

    def cost(self, model: str | None, input_tokens: int | None, output_tokens: int | None) -> tuple[float | None, str | None]:
        """(cost in USD, None), or (None, why there is no cost)."""
        if input_tokens is None and output_tokens is None:
            return None, "the agent reported no token counts"
        if not input_tokens and not output_tokens:  # nothing used (every call refused): free whatever the model
            return 0.0, None
        if model is None:
            return None, "the agent reported tokens but no model to price them by"
        price = self.user.get(model)
        if price is not None:
            cost = price.cost(input_tokens or 0, output_tokens or 0)
        else:
            cost = _listed_cost(model, input_tokens or 0, output_tokens or 0)
        if cost is None:
            where = f"genai-prices {_prices_version()}" + (f" or {self.source}" if self.source else "")
            return None, f"no price for model {model!r} in {where} (add it to a price file: --prices)"
        if not math.isfinite(cost):  # a float overflow: unknown, never inf (nor NaN, which no budget reaches)
            return None, f"the cost of {model!r} for these counts is not a finite number"
        return cost, None


def _price(where: str, model: object, entry: object) -> Price:
    if not isinstance(entry, dict) or set(entry) != set(_PRICE_KEYS):
        raise InputError(f"{where}: model {model!r}: expected exactly {', '.join(_PRICE_KEYS)}")
    values = [entry[key] for key in _PRICE_KEYS]
    # Finite too: inf x 0 tokens is NaN, which never reaches a budget's limit.
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values):
        raise InputError(f"{where}: model {model!r}: prices must be finite numbers of dollars >= 0")
    return Price(*map(float, values))


@lru_cache(maxsize=4096)
def _listed_cost(model: str, input_tokens: int, output_tokens: int) -> float | None:
    # Imported here: loading the table takes ~0.2 s, paid only by runs that report tokens.
    from genai_prices import Usage, calc_price

    try:
        calc = calc_price(Usage(input_tokens=input_tokens, output_tokens=output_tokens), model)
    except LookupError:
        return None
    return float(calc.total_price)


def _prices_version() -> str:
    from importlib.metadata import version

    return version("genai-prices")
