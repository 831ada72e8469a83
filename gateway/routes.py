"""Every route of the gateway, in one table."""

from aiohttp import web

from kvrelay.gateway import admin, model_admin
from kvrelay.gateway.chat import create_chat_completion
from kvrelay.gateway.completions import create_completion
from kvrelay.gateway.info import admin_openapi, health, list_models, openapi, ready
from kvrelay.gateway.metrics_route import scrape
from kvrelay.gateway.tokenize import detokenize, tokenize

ROUTES = [
    web.post("/v1/completions", create_completion),
    web.post("/v1/chat/completions", create_chat_completion),
    web.get("/v1/models", list_models),
    web.post("/tokenize", tokenize),
    web.post("/detokenize", detokenize),
    web.get("/health", health),
    web.get("/ready", ready),
    web.get("/openapi.json", openapi),
    web.get("/metrics", scrape),
    web.post("/admin/tenants", admin.put_tenant),
    web.get("/admin/tenants", admin.list_tenants),
    web.post("/admin/keys", admin.create_key),
    web.get("/admin/keys", admin.list_keys),
    web.delete("/admin/keys/{id}", admin.delete_key),
    web.get("/admin/usage", admin.usage),
    web.get("/admin/models", model_admin.list_models),
    web.post("/admin/models", model_admin.register_model),
    web.delete("/admin/models/{name}", model_admin.delete_model),
    web.post("/admin/models/{name}/load", model_admin.load_model),
    web.post("/admin/models/{name}/unload", model_admin.unload_model),
    web.post("/admin/models/{name}/swap", model_admin.swap_model),
    web.get("/admin/openapi.json", admin_openapi),
]
