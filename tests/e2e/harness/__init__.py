"""What the end-to-end tests run the application with: the suite's cluster, its apps, and how tests reach them."""
