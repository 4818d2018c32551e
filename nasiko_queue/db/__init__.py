"""
The database layer: connections, the named statements (queries.sql), migrations,
the embedded server.
"""
