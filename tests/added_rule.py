"""A rule added to the rule table in a fresh process, before any pass imports the table.

``ADD_RULE`` is Python source for the start of such a process: it reads a JSON
file (``sys.argv[1]``) whose ``"rules"`` are ``OpRule(...)`` expressions, puts
them into a copy of ``compiler/ops.py`` just before ``OPS`` is derived from
``RULES``, and installs that copy as ``pipec.compiler.ops``. Every module
imported after it sees the larger table, as if the rules had been written in
it. ``tests/test_ir_example.py`` and ``tests/test_ops_table.py`` use it.
"""

ADD_RULE = r'''
import importlib.util, json, pathlib, sys
import pipec.compiler

example = json.loads(pathlib.Path(sys.argv[1]).read_text())
path = pathlib.Path(pipec.compiler.__file__).parent / "ops.py"
anchor = "\nOPS: tuple[str, ...] = tuple(RULES)"
source = path.read_text()
assert anchor in source, "the rule table's anchor moved; update tests/added_rule.py"
added = "".join(f"\n_added = {rule}\nRULES[_added.op] = _added\n" for rule in example["rules"])
source = source.replace(anchor, added + anchor)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("pipec.compiler.ops", loader=None))
module.__file__ = str(path)
sys.modules["pipec.compiler.ops"] = module
exec(compile(source, str(path), "exec"), module.__dict__)
'''
