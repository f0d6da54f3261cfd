# One image for every tokenmill process: the CLI, Celery workers, beat, Flower and the SGLang
# emulator. docker-compose.yml picks the process with `command:`; the default prints the help.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# an unprivileged account whose home is the working directory (tokenizer cache, .tokenmill)
RUN groupadd --system --gid 10001 tokenmill \
    && useradd --system --uid 10001 --gid tokenmill --home-dir /srv --no-create-home \
        --shell /usr/sbin/nologin tokenmill \
    && mkdir -p /srv \
    && chown tokenmill:tokenmill /srv

# install from a copy of the sources, then drop the copy: the image runs the installed package
COPY pyproject.toml README.md /tmp/tokenmill/
COPY app /tmp/tokenmill/app
COPY workers /tmp/tokenmill/workers
COPY ops /tmp/tokenmill/ops
COPY emulator /tmp/tokenmill/emulator
COPY migrations /tmp/tokenmill/migrations
RUN pip install /tmp/tokenmill \
    && rm -rf /tmp/tokenmill

WORKDIR /srv
USER tokenmill:tokenmill
ENV HOME=/srv \
    HF_HOME=/srv/.cache/huggingface

CMD ["tokenmill", "--help"]
