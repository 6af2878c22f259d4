"""What the server keeps: the SQLite store, tenants and keys, paths and files on the data disk, recovery."""
