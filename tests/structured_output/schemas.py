"""A mixed set of constrained-output requests with realistic chat prompts: JSON schemas of different
features, regexes and choice lists. The SmolLM2 tests check every answer against its constraint;
``benchmarks/structured_outputs.py`` cycles through the schemas.

Every string is bounded (``maxLength``, a pattern with bounded repeats, an enum, or a date, uuid or
ipv4 format), but for the date-times' fractional seconds, which RFC 3339 leaves unbounded, and every
array has ``maxItems``, so each answer ends well within ``MAX_TOKENS``.

String formats: both backends enforce ``date``, ``date-time``, ``time``, ``email``, ``uuid``, ``ipv4``,
``ipv6``, ``hostname``, ``uri`` and ``duration`` by their RFC syntax. ``format_checker()`` checks the
formats the set uses: ``date``, ``email``, ``uuid`` and ``ipv4`` with jsonschema's own checkers, and
``date-time`` (for which jsonschema needs an extra package) with the standard library's ISO 8601 parser.
Limits of xgrammar (0.2.9) the set stays clear of: its ``date`` takes any day 01-31 in any month
(``2024-02-30``; the guidance backend and jsonschema check the calendar), and it ignores ``minLength`` /
``maxLength`` beside a ``pattern`` or ``format``, so such a string is bounded only by its pattern.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

MAX_TOKENS = 256
"""Output tokens each answer of the set ends within."""


@dataclass(frozen=True)
class SchemaCase:
    """A request whose answer is JSON that validates ``schema``."""

    name: str
    ask: str
    """What the user asks for; ``prompt`` adds the schema."""
    schema: dict
    features: tuple[str, ...]
    """The JSON schema features it exercises (``SCHEMA_FEATURES``)."""

    @property
    def prompt(self) -> str:
        return f"{self.ask} Reply with JSON only, following this schema: {json.dumps(self.schema)}"


@dataclass(frozen=True)
class RegexCase:
    """A request whose whole answer matches ``regex``."""

    name: str
    prompt: str
    regex: str


@dataclass(frozen=True)
class ChoiceCase:
    """A request whose answer is one of ``choices``."""

    name: str
    prompt: str
    choices: tuple[str, ...]


SCHEMA_FEATURES = ("nested-object", "array-bounds", "enum", "anyOf", "integer-range", "number-range",
                   "exclusive-range", "required-optional", "format", "pattern", "string-length", "const",
                   "boolean", "null", "array-of-objects", "nested-array", "ref", "allOf",
                   "top-level-array", "no-additional-properties")
"""Every feature the set covers; each appears in at least one schema. ``allOf`` of two schemas is
the one xgrammar does not enforce: ``auto`` compiles it with the guidance backend."""


def _str(max_length: int, min_length: int = 1) -> dict:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


SCHEMAS: list[SchemaCase] = [
    SchemaCase(
        "user_record", "Give me a user record as JSON: a name, an age and an email address.",
        {"type": "object", "properties": {"name": _str(40), "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120},
                                          "email": {"type": "string", "format": "email"}},
         "required": ["name", "age", "email"], "additionalProperties": False},
        ("integer-range", "format", "string-length", "no-additional-properties")),
    SchemaCase(
        "shipping_address", "Write the shipping address of a customer in Chicago.",
        {"type": "object", "properties": {
            "recipient": _str(40),
            "address": {"type": "object", "properties": {
                "street": _str(50), "city": _str(30), "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "CA", "MX"]}},
                "required": ["street", "city", "zip", "country"]}},
         "required": ["recipient", "address"]},
        ("nested-object", "pattern", "enum", "string-length")),
    SchemaCase(
        "order", "Create an order for two items from an online hardware store.",
        {"type": "object", "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["sku", "quantity"]}},
            "total": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}},
         "required": ["order_id", "items", "total"]},
        ("format", "array-of-objects", "array-bounds", "pattern", "integer-range", "exclusive-range",
         "number-range")),
    SchemaCase(
        "weather", "What is the weather like in Oslo today? Answer as a weather report.",
        {"type": "object", "properties": {
            "city": _str(30), "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
            "condition": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
            "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100}},
         "required": ["city", "temperature_c", "condition", "humidity_pct"]},
        ("number-range", "enum", "integer-range")),
    SchemaCase(
        "calendar_event", "Schedule a team meeting next week and list who attends.",
        {"type": "object", "properties": {
            "title": _str(50), "date": {"type": "string", "format": "date"},
            "starts_at": {"type": "string", "format": "date-time"},
            "attendees": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 4}},
         "required": ["title", "date", "attendees"]},
        ("format", "array-bounds", "required-optional")),
    SchemaCase(
        "product", "Describe a product sold in a coffee shop, with its price and a few tags.",
        {"type": "object", "properties": {
            "name": _str(40), "price": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": _str(15), "minItems": 1, "maxItems": 3}},
         "required": ["name", "price", "in_stock", "tags"]},
        ("exclusive-range", "number-range", "boolean", "array-bounds", "string-length")),
    SchemaCase(
        "contact_method", "How can I reach the support team? Give one contact method.",
        {"type": "object", "properties": {
            "team": _str(30),
            "contact": {"anyOf": [
                {"type": "object", "properties": {"email": {
                    "type": "string", "pattern": "^[a-z0-9._]{1,20}@[a-z0-9]{1,15}\\.(com|org|net)$"}},
                 "required": ["email"]},
                {"type": "object", "properties": {"phone": {"type": "string",
                                                            "pattern": "^\\+[0-9]{7,12}$"}},
                 "required": ["phone"]}]}},
         "required": ["team", "contact"]},
        ("anyOf", "nested-object", "pattern")),
    SchemaCase(
        "book", "Tell me about a classic novel: its title, author, year and genres.",
        {"type": "object", "properties": {
            "title": _str(60), "author": _str(40),
            "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
            "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
            "genres": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "string", "enum": ["fiction", "romance", "mystery", "science fiction", "history",
                                           "adventure", "drama"]}}},
         "required": ["title", "author", "year", "genres"]},
        ("integer-range", "pattern", "enum", "array-bounds", "required-optional")),
    SchemaCase(
        "api_status", "Report the status of the payments API.",
        {"type": "object", "properties": {
            "api_version": {"const": "v2"}, "status": {"type": "string", "enum": ["ok", "degraded", "down"]},
            "message": _str(60)},
         "required": ["api_version", "status", "message"]},
        ("const", "enum", "string-length")),
    SchemaCase(
        "person_names", "Give me the full name of a famous scientist as a person record.",
        {"type": "object", "properties": {
            "first_name": _str(30), "middle_name": {"anyOf": [_str(30), {"type": "null"}]},
            "last_name": _str(30), "nickname": {"type": ["string", "null"], "maxLength": 20}},
         "required": ["first_name", "middle_name", "last_name"]},
        ("null", "anyOf", "required-optional", "string-length")),
    SchemaCase(
        "matrix", "Give me a small matrix of single-digit numbers.",
        {"type": "object", "properties": {
            "matrix": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
                "type": "array", "minItems": 2, "maxItems": 3,
                "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
         "required": ["matrix"]},
        ("nested-array", "array-bounds", "integer-range")),
    SchemaCase(
        "team", "List the members of a small software team and their roles.",
        {"type": "object", "properties": {
            "team_name": _str(30),
            "members": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "name": _str(30), "role": {"type": "string", "enum": ["engineer", "designer", "manager"]},
                    "active": {"type": "boolean"}},
                "required": ["name", "role", "active"]}}},
         "required": ["team_name", "members"]},
        ("array-of-objects", "array-bounds", "enum", "boolean")),
    SchemaCase(
        "color", "Pick a color for a website's main button.",
        {"type": "object", "properties": {
            "name": _str(20), "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            "rgb": {"type": "array", "minItems": 3, "maxItems": 3,
                    "items": {"type": "integer", "minimum": 0, "maximum": 255}}},
         "required": ["name", "hex", "rgb"]},
        ("pattern", "array-bounds", "integer-range")),
    SchemaCase(
        "location", "Where is the Eiffel Tower? Give its coordinates.",
        {"type": "object", "properties": {
            "label": _str(40), "latitude": {"type": "number", "minimum": -90, "maximum": 90},
            "longitude": {"type": "number", "minimum": -180, "maximum": 180}},
         "required": ["label", "latitude", "longitude"]},
        ("number-range",)),
    SchemaCase(
        "recipe", "Give me a simple pancake recipe.",
        {"type": "object", "properties": {
            "title": _str(40), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
                "type": "object", "properties": {
                    "item": _str(20), "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    "unit": {"type": "string", "enum": ["g", "ml", "cup", "tbsp", "piece"]}},
                "required": ["item", "amount", "unit"]}},
            "vegetarian": {"type": "boolean"}},
         "required": ["title", "servings", "ingredients", "vegetarian"]},
        ("array-of-objects", "exclusive-range", "enum", "boolean", "integer-range")),
    SchemaCase(
        "movie_review", "Write a short review of the movie Inception.",
        {"type": "object", "properties": {
            "movie": _str(40), "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "recommend": {"type": "boolean"}, "summary": _str(120, min_length=10)},
         "required": ["movie", "rating", "recommend", "summary"]},
        ("integer-range", "boolean", "string-length")),
    SchemaCase(
        "server_config", "Write the configuration of a web server that listens on an internal address.",
        {"type": "object", "properties": {
            "host": {"type": "string", "format": "ipv4"},
            "port": {"type": "integer", "minimum": 1024, "maximum": 65535},
            "tls": {"type": "boolean"},
            "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
            "timeouts": {"type": "object", "properties": {
                "connect_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                "read_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 300}},
                "required": ["connect_s", "read_s"], "additionalProperties": False}},
         "required": ["host", "port", "tls", "log_level", "timeouts"]},
        ("format", "integer-range", "nested-object", "exclusive-range", "enum", "no-additional-properties")),
    SchemaCase(
        "capitals", "List three European countries and their capitals.",
        {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object", "properties": {"country": _str(30), "capital": _str(30)},
            "required": ["country", "capital"]}},
        ("top-level-array", "array-of-objects", "array-bounds")),
    SchemaCase(
        "ticket", "Open a support ticket for a customer who cannot log in.",
        {"type": "object", "properties": {
            "id": {"type": "string", "format": "uuid"},
            "created_at": {"type": "string", "format": "date-time"},
            "status": {"type": "string", "enum": ["open", "pending", "closed"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 4},
            "subject": _str(60)},
         "required": ["id", "created_at", "status", "priority", "subject"]},
        ("format", "enum", "integer-range")),
    SchemaCase(
        "arithmetic", "What is 6 times 7? Put the answer in the value field.",
        {"type": "object", "properties": {
            "question": _str(40),
            "value": {"anyOf": [{"type": "integer", "minimum": -1000, "maximum": 1000}, _str(20),
                                {"type": "null"}]}},
         "required": ["question", "value"]},
        ("anyOf", "null", "integer-range")),
    SchemaCase(
        "flight", "Give me the details of a morning flight from Boston to Denver.",
        {"type": "object", "properties": {
            "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "departure": {"type": "string", "format": "date-time"},
            "seats_left": {"type": "integer", "minimum": 0, "maximum": 300},
            "status": {"type": "string", "enum": ["scheduled", "boarding", "delayed", "cancelled"]}},
         "required": ["flight_number", "from", "to", "departure", "seats_left", "status"]},
        ("pattern", "format", "integer-range", "enum")),
    SchemaCase(
        "invoice", "Write an invoice for a customer in Berlin who bought a laptop.",
        {"type": "object", "properties": {
            "customer": {"type": "object", "properties": {
                "name": _str(40),
                "address": {"type": "object", "properties": {
                    "city": _str(30), "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "postcode"]}},
                "required": ["name", "address"]},
            "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                "type": "object", "properties": {
                    "description": _str(40), "unit_price": {"type": "number", "minimum": 0, "maximum": 5000},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["description", "unit_price", "quantity"]}},
            "paid": {"type": "boolean"}},
         "required": ["customer", "lines", "paid"]},
        ("nested-object", "array-of-objects", "pattern", "number-range", "boolean")),
    SchemaCase(
        "article_tags", "Suggest distinct topic tags for a news article about electric cars.",
        {"type": "object", "properties": {
            "headline": _str(60),
            "tags": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
                "type": "string",
                "enum": ["cars", "energy", "climate", "technology", "business", "policy"]}}},
         "required": ["headline", "tags"]},
        ("enum", "array-bounds")),
    SchemaCase(
        "account", "Create a bank account holder record with a username and a balance.",
        {"allOf": [
            {"type": "object", "required": ["username"],
             "properties": {"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"}}},
            {"type": "object", "properties": {
                "balance": {"type": "number", "minimum": 0, "maximum": 1000000},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]}},
             "required": ["balance", "currency"]}]},
        ("allOf", "pattern", "number-range", "enum")),
    SchemaCase(
        "pet_owner", "Describe a pet owner and their pets.",
        {"$defs": {"Pet": {"type": "object", "properties": {
            "name": _str(20), "species": {"type": "string", "enum": ["dog", "cat", "bird", "fish"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 30}},
            "required": ["name", "species", "age"]}},
         "type": "object", "properties": {
            "owner": _str(40), "pets": {"type": "array", "minItems": 1, "maxItems": 2,
                                        "items": {"$ref": "#/$defs/Pet"}}},
         "required": ["owner", "pets"]},
        ("ref", "array-of-objects", "enum", "integer-range")),
    SchemaCase(
        "network_device", "Describe a network printer in the office.",
        {"type": "object", "properties": {
            "hostname": {"type": "string", "pattern": "^[a-z][a-z0-9-]{2,20}$"},
            "ip": {"type": "string", "format": "ipv4"},
            "mac": {"type": "string", "pattern": "^([0-9a-f]{2}:){5}[0-9a-f]{2}$"},
            "online": {"type": "boolean"}},
         "required": ["hostname", "ip", "mac", "online"]},
        ("pattern", "format", "boolean")),
    SchemaCase(
        "sentiment", "Analyze the sentiment of this review: 'The battery life is amazing but the screen "
                     "scratches easily.'",
        {"type": "object", "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "mixed", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "keywords": {"type": "array", "items": _str(20), "maxItems": 3}},
         "required": ["sentiment", "confidence", "keywords"]},
        ("enum", "number-range", "array-bounds")),
    SchemaCase(
        "meeting_time", "When should we hold the weekly planning meeting?",
        {"type": "object", "properties": {
            "meeting": {"type": "object", "properties": {
                "day": {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]},
                "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "duration_min": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 240}},
                "required": ["day", "time", "duration_min"]},
            "remote": {"type": "boolean"}},
         "required": ["meeting"]},
        ("nested-object", "pattern", "exclusive-range", "required-optional", "boolean")),
    SchemaCase(
        "employee", "Create an employee profile for a new hire in the sales department.",
        {"type": "object", "properties": {
            "employee_id": {"type": "string", "pattern": "^E[0-9]{5}$"},
            "full_name": _str(40),
            "department": {"type": "string", "enum": ["sales", "engineering", "support", "finance"]},
            "start_date": {"type": "string", "format": "date"},
            "manager_id": {"type": ["string", "null"], "pattern": "^E[0-9]{5}$"},
            "skills": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 3}},
         "required": ["employee_id", "full_name", "department", "start_date", "manager_id"],
         "additionalProperties": False},
        ("pattern", "enum", "format", "null", "array-bounds", "required-optional",
         "no-additional-properties")),
]

REGEXES: list[RegexCase] = [
    RegexCase("phone", "What is the phone number of a pizza place in New York? Give a US phone number.",
              r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    RegexCase("iso_date", "On what date did Apollo 11 land on the moon? Answer as YYYY-MM-DD.",
              r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    RegexCase("ipv4", "What is the usual IP address of a home router?",
              r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    RegexCase("email", "Make up an email address for a customer named Jane Doe.",
              r"[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.(com|org|net)"),
    RegexCase("clock_time", "What time does a typical office open in the morning? Answer as HH:MM.",
              r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    RegexCase("hex_color", "What is the hex code of pure red?", r"#[0-9a-f]{6}"),
    RegexCase("case_insensitive", "Is Mercury the planet closest to the Sun? Answer yes or no.",
              r"(?i)(yes|no)"),
    RegexCase("yes_no_reason", "Is water wet? Answer yes or no and give a short reason.",
              r"(Yes|No), because [a-z ,]{5,60}\."),
]

CHOICES: list[ChoiceCase] = [
    ChoiceCase("sentiment", "Classify the sentiment of this review: 'I loved this movie!'",
               ("positive", "negative", "neutral")),
    ChoiceCase("capital", "What is the capital of France?", ("Paris", "London", "Berlin", "Madrid")),
    ChoiceCase("language", "Which programming language is best known for its borrow checker?",
               ("Python", "JavaScript", "Rust", "Go")),
    ChoiceCase("yes_no", "Is the Earth round?", ("yes", "no")),
    ChoiceCase("sky", "What color is a clear daytime sky?", ("red", "green", "blue", "yellow")),
    ChoiceCase("priority", "The production database is down for every customer. What priority is this "
                           "ticket?", ("low", "medium", "high", "critical")),
]


def feature_coverage() -> dict[str, int]:
    """How many schemas exercise each feature of ``SCHEMA_FEATURES``."""
    return {f: sum(f in case.features for case in SCHEMAS) for f in SCHEMA_FEATURES}


def _is_date_time(value: Any) -> bool:
    if not isinstance(value, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?"
                                                      r"([Zz]|[+-]\d{2}:\d{2})", value):
        return False
    try:
        datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def format_checker():
    """jsonschema's format checker (``date``, ``email``, ``uuid``, ``ipv4``, ``ipv6`` here) with RFC 3339
    ``date-time`` added."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    checker.checks("date-time")(_is_date_time)
    return checker
