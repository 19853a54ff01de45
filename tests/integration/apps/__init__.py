"""Small apps for the tests of several apps on one broker and of rolling deploys."""
