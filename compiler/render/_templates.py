"""The jinja2 templates of the drawings, read from the package with importlib.resources
(so they work from an installed wheel as well as from the source tree)."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

import jinja2


def _source(name: str) -> str:
    return (resources.files(__package__) / "templates" / name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    """One environment for every drawing.

    Autoescaping is off because the templates emit SVG, HTML, DOT and
    JavaScript, each with its own quoting; every value that can hold user text
    (schedule names, wait descriptions) goes through the ``xml`` or ``dot``
    filter where it is written.
    """
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(_source),
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["xml"] = xml_escape
    env.filters["dot"] = dot_escape
    return env


def render(template: str, /, **context) -> str:
    """Returns: ``template`` rendered with ``context``."""
    return environment().get_template(template).render(**context)


_XML = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})


def xml_escape(text) -> str:
    """Returns: ``text`` safe inside XML/HTML text and double-quoted attributes."""
    return str(text).translate(_XML)


def dot_escape(text) -> str:
    """Returns: ``text`` safe inside a double-quoted DOT string (newlines become DOT's ``\\n``)."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
