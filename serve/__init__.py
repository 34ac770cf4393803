"""llmx's OpenAI-compatible server. ``create_app`` is the app factory (gunicorn:
``gunicorn 'llmx.serve:create_app("./art")' -c deploy/gunicorn.conf.py``); flask is imported
only when it is called, so ``import llmx.serve`` stays light."""


def create_app(*args, **kwargs):
    from llmx.serve.app import create_app as _create_app

    return _create_app(*args, **kwargs)
