import pytest


@pytest.mark.django_db
def test_admin_styles_are_served_without_collectstatic(client):
    response = client.get("/static/admin/css/base.css")
    assert response.status_code == 200
    assert b"".join(response.streaming_content)


@pytest.mark.parametrize("path", ["/static/../apiary_site/settings.py", "/static/admin/../../settings.py", "/static/nope.css"])
def test_static_paths_cannot_escape_the_apps(client, path):
    assert client.get(path).status_code in (400, 404)
