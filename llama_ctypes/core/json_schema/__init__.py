"""The JSON Schema → GBNF compiler, one module a job (``convert`` is the entry point).

* ``convert``: checks a schema, normalizes it, calls llama.cpp's converter (through the C
  adapter) and links in the rules written here (:func:`convert.json_schema_to_gbnf`);
* ``normalize``: rewrites a schema into the forms the converter enforces exactly;
* ``numbers``: bounded ``number``/``integer`` as exact decimal digit ranges;
* ``strings``: ``pattern`` (a regular-expression subset) and calendar ``format``\\ s;
* ``limits``: bounds on a schema's size (:class:`limits.SchemaLimits`), checked before any work.

This file imports none of them: importing one module does not load the others.
"""
