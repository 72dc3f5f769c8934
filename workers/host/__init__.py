"""One engine per worker process, driven by one thread, and fair admission across tenants."""
