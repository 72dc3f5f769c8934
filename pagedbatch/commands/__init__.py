"""The CLI's subcommands, one module per group: admin, client, doctor, engine, server."""
