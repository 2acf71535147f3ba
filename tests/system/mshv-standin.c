// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for the Microsoft hypervisor's device, /dev/mshv, for the whole-system test.
 *
 * The real driver (mainline Linux's mshv_root module, drivers/hv/mshv_root_main.c, on a Hyper-V root
 * partition) registers a misc device named "mshv" with a dynamic minor and mode 0600. This module does
 * the same and nothing more: the kernel gives it a misc minor when it loads, devtmpfs and udev make
 * /dev/mshv, the node opens and closes, and every ioctl answers ENOTTY (no hypervisor is behind it). Unloading it removes the
 * device, with the kernel's and udev's remove events, as unloading the real driver would.
 *
 * Built twice: as mshv_standin (the device "mshv") and, with STANDIN_NAME set, as a second module
 * whose device takes a dynamic minor of its own, so that the test can make the next "mshv" get
 * another minor.
 */
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/module.h>

#ifndef STANDIN_NAME
#define STANDIN_NAME "mshv"
#endif

static long standin_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	return -ENOTTY;
}

static const struct file_operations standin_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = standin_ioctl,
	.compat_ioctl = standin_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice standin_device = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = STANDIN_NAME,
	.fops = &standin_fops,
	.mode = 0600,
};

module_misc_device(standin_device);

MODULE_DESCRIPTION("A misc device named " STANDIN_NAME " with a dynamic minor, standing in for /dev/mshv");
MODULE_LICENSE("GPL");
