"""The S3 fixture is a real endpoint with real auth: a signed request works, a bad key is refused."""

from __future__ import annotations

import pytest
from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.support.s3server import S3Server


def client(server: S3Server, secret: str):  # type: ignore[no-untyped-def]
    return get_session().create_client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.access_key,
        aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": "path"}),
    )


async def test_signed_round_trip_and_bad_signature_refused(s3_server: S3Server) -> None:
    async with client(s3_server, s3_server.secret_key) as s3:
        await s3.create_bucket(Bucket="fixture-check")
        await s3.put_object(Bucket="fixture-check", Key="k", Body=b"payload")
        got = await s3.get_object(Bucket="fixture-check", Key="k")
        async with got["Body"] as body:
            assert await body.read() == b"payload"
    async with client(s3_server, "wrong-secret") as s3:
        with pytest.raises(ClientError) as err:
            await s3.get_object(Bucket="fixture-check", Key="k")
        assert err.value.response["Error"]["Code"] in {
            "SignatureDoesNotMatch",
            "AccessDenied",
            "InvalidAccessKeyId",
        }
