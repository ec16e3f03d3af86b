"""The worker protocol, version 1 (shared/PROTOCOL.md), on Django REST framework.

Views translate HTTP to `jobqueue.services` / `jobqueue.selectors` calls and
back; nothing here writes queue rows. Bodies are read with a hard cap and
parsed with limits (`parsers`), errors of every kind leave through one
exception handler (`errors`), and every response carries `Apiary-Protocol: 1`.
"""
