"""A gateway process of its own freezes what exists once its app has started (gateway/app.py): a full collection
then walks only what came after, not every object its imports made. An app made in someone else's process (the
tests', a library user's) never freezes theirs."""

import gc

from kvrelay.gateway import app as gateway_app
from kvrelay.shared.config.gateway import GatewayConfig


def test_the_gateway_process_freezes_after_its_startup_and_an_app_alone_does_not(monkeypatch):
    served = []

    async def fake_serve(app, *args):
        served.append(app)

    monkeypatch.setattr(gateway_app, "serve", fake_serve)
    gateway_app.run_gateway(GatewayConfig(redis_url="redis://127.0.0.1:1/0"))
    [app] = served
    # last: aiohttp runs the cleanup contexts' startups first, so what they build is frozen too
    assert list(app.on_startup)[-1] is gateway_app.freeze_long_lived
    assert gateway_app.freeze_long_lived not in gateway_app.create_app(GatewayConfig()).on_startup


async def test_freezing_moves_what_exists_to_the_permanent_generation():
    before = gc.get_freeze_count()
    try:
        await gateway_app.freeze_long_lived(None)
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
