"""The `dilocox-peer` command line: thin wrappers that parse, load config and call the library."""
