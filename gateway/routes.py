"""Every route of the gateway, in one table: the OpenAI API (and SageMaker's /invocations), the probes, the version and the API description, then
the admin API of the tenancy and control rooms."""

from aiohttp import web

from kvrelay.gateway.api.chat import create_chat_completion
from kvrelay.gateway.api.completions import create_completion
from kvrelay.gateway.api.invocations import invocations
from kvrelay.gateway.api.model_list import list_models
from kvrelay.gateway.api.tokenize_route import detokenize, tokenize
from kvrelay.gateway.control import model_admin
from kvrelay.gateway.openapi import admin_openapi, openapi
from kvrelay.gateway.probes import health, ready, scrape
from kvrelay.gateway.tenancy import tenant_admin
from kvrelay.gateway.version import version

ROUTES = [
    web.post("/v1/completions", create_completion),
    web.post("/v1/chat/completions", create_chat_completion),
    web.get("/v1/models", list_models),
    web.post("/tokenize", tokenize),
    web.post("/detokenize", detokenize),
    web.post("/invocations", invocations),
    web.get("/version", version),
    web.get("/health", health),
    web.get("/ready", ready),
    web.get("/openapi.json", openapi),
    web.get("/metrics", scrape),
    web.post("/admin/tenants", tenant_admin.put_tenant),
    web.get("/admin/tenants", tenant_admin.list_tenants),
    web.post("/admin/keys", tenant_admin.create_key),
    web.get("/admin/keys", tenant_admin.list_keys),
    web.delete("/admin/keys/{id}", tenant_admin.delete_key),
    web.get("/admin/usage", tenant_admin.usage),
    web.get("/admin/models", model_admin.list_models),
    web.post("/admin/models", model_admin.register_model),
    web.delete("/admin/models/{name}", model_admin.delete_model),
    web.post("/admin/models/{name}/load", model_admin.load_model),
    web.post("/admin/models/{name}/unload", model_admin.unload_model),
    web.post("/admin/models/{name}/swap", model_admin.swap_model),
    web.get("/admin/openapi.json", admin_openapi),
]
