"""Imported first by the server's entry points (``scheduler.launch``, ``scheduler.http.server``): keeps what the
server never uses from being imported along with what it does.

jsonschema imports ``rfc3987_syntax`` whenever it is installed (by the test extra's ``jsonschema[format-nongpl]``;
jsonschema checks the ``iri`` formats with it), and that module builds 39 lark parsers at import: nearly all of
what importing jsonschema costs, in every server process (the scheduler, its compile processes' fork server, the
HTTP frontend). The server validates a schema against its metaschema and never checks a
string's format, so it goes without; a process that checks formats (the tests) imports jsonschema as it is.
"""

import sys

# A None entry in sys.modules makes importing that name raise ImportError, which jsonschema takes as "not installed".
sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]
