"""The OpenAPI 3.1 document: `openapi` (the document at /openapi.json), its operations (`openapi_ops`), the uploads
and webhook paths (`openapi_events`), and the schemas generated from the pydantic declarations (`openapi_schemas`)."""
